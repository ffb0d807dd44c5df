"""Block files of the SSD and shared tiers: one file per block and TP rank.

A file is a 64-byte header (magic, format, checksum algorithm, payload length, xxh3-64 of the
payload, the KV layout fingerprint, the block key) followed by the block's bytes. Writes go to a
hidden temporary file in the same directory and are renamed into place only when complete, so a
crash mid-save leaves no file under the block's name (at most a temporary that
:meth:`FileStore.scan` deletes later). Reads are ``preadv`` calls of header and payload straight
into the caller's buffers (the pieces of a KV block where they live), each group of bytes hashed
as it lands; then every header field, the file's exact length and the checksum of what landed
are checked. Any difference raises :class:`BlockFileError` and the caller treats the block as
missing (bytes that landed are never used); the file is deleted (so the block is saved again)
and a warning logged, at most one line per :data:`LOG_EVERY_S` and store (whoever can write the
directory can make reads fail at will). Files of another format (e.g. the CRC-32 files of
format 2) are such a difference.

With a fleet key (:mod:`vllm_pd_ext.fleet_key`) files carry a MAC instead: the header's
algorithm is :data:`MAC_BLAKE3_KEYED`, its checksum field 0, and 32 bytes of MAC follow it (96
bytes before the payload). The MAC is keyed BLAKE3, under a key derived from the fleet key for
this use only (:func:`mac_key`), of what names the block (format, namespace, block key, TP
rank, layout fingerprint, payload length) and then the payload, computed while the payload
lands like the checksum. xxh3 is no MAC: anyone who can write the directory can make a file
that passes it, and block keys are computable from a prompt. A MAC is made only by holders of
the key, and one made for a block is valid for no other (a file copied to another name, rank
or namespace fails). A store reads only the kind of file it writes: with a key, a file without
a MAC is a miss; without one, a file with a MAC is a miss too (it cannot be checked).

The directories may be shared (the shared tier) or sit under a world-writable parent, so
nothing in them is followed blindly: the namespace directory and its subdirectories must be
real directories owned by this user and writable by nobody else (made 0700); temporary files
get unpredictable names and are created with ``O_EXCL | O_NOFOLLOW`` and mode 0600 (a planted
link is never written through); reads open with ``O_NOFOLLOW`` (a link where a block file
should be is a corrupt block: deleted, never read).
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import logging
import os
import stat
import struct
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

import blake3
import xxhash

from vllm_pd_ext import fleet_key
from vllm_pd_ext.connectors.flexkv.keys import FORMAT
from vllm_pd_ext.util.throttle import Throttle

logger = logging.getLogger(__name__)

MAGIC = b"PDEXTKV\x00"
#: magic, format, checksum algorithm, payload length, checksum, layout fingerprint, key
_HEADER = struct.Struct("<8sIIQQ16s16s")
HEADER_BYTES = _HEADER.size  # 64
#: The checksum algorithm id of unkeyed files: xxh3-64 of the payload (seed 0).
CHECKSUM_XXH3_64 = 1
#: The algorithm id of files written with a fleet key: a keyed BLAKE3 MAC follows the header.
MAC_BLAKE3_KEYED = 2
#: Bytes of the MAC after the header of a keyed file.
MAC_BYTES = 32
#: The label the MAC key is derived from the fleet key under (:func:`mac_key`).
MAC_LABEL = "vllm-pd-ext flexkv block file MAC v1"
#: Seconds between two warnings about discarded block files of one store.
LOG_EVERY_S = 10.0
#: Buffers per ``preadv`` call (Linux's IOV_MAX is 1024).
_IOV_MAX = 1000
#: Bytes per ``preadv`` call of a block read, hashed before the next call.
_GROUP_BYTES = 256 << 10
#: Temporary files older than this are leftovers of a crash and are deleted by scan().
STALE_TMP_S = 600.0


class BlockFileError(RuntimeError):
    """A block file exists but cannot be trusted (truncated, corrupt, other layout)."""


#: Creating a temporary block file: never through a link, never an existing file.
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


def own_dir(path: Path) -> None:
    """Make ``path`` a directory only this user may use (0700), or raise ``OSError`` when
    it is something else: a link, not a directory, another user's, or writable by others
    (whoever controls it could swap the files in it)."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, "not a directory (a link?)", str(path))
    if st.st_uid != os.geteuid():
        raise PermissionError(errno.EPERM, f"owned by uid {st.st_uid}, not us", str(path))
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)


def fp16_of(fingerprint: str) -> bytes:
    return fingerprint.encode()[:16].ljust(16, b"\0")


def byte_views(bufs) -> list[memoryview]:
    """One buffer or a sequence of buffers as a list of byte memoryviews."""
    return [memoryview(b).cast("B") for b in (bufs if isinstance(bufs, list | tuple) else [bufs])]


def checksum(parts: Sequence[memoryview]) -> int:
    """xxh3-64 of the concatenation of ``parts`` (byte views)."""
    if len(parts) == 1:
        return xxhash.xxh3_64_intdigest(parts[0])
    h = xxhash.xxh3_64()
    for p in parts:
        h.update(p)
    return h.intdigest()


def mac_key(key: bytes) -> bytes:
    """The key of the block files' MAC, derived from the fleet key ``key`` under
    :data:`MAC_LABEL` (so it is the key of no other use); 32 bytes, BLAKE3's key size."""
    return fleet_key.tag(key, MAC_LABEL)


def _block_mac(
    mac_key: bytes, namespace: str, key: str, rank: int, fp16: bytes, length: int
) -> blake3.blake3:
    """A keyed BLAKE3 fed with what names a block (each part length-prefixed), ready for the
    block's payload: its digest is the block file's MAC."""
    h = blake3.blake3(key=mac_key)
    for part in (
        FORMAT.to_bytes(4, "little"),
        namespace.encode(),
        bytes.fromhex(key),
        rank.to_bytes(4, "little"),
        fp16,
        length.to_bytes(8, "little"),
    ):
        h.update(len(part).to_bytes(8, "little") + part)
    return h


def _fill(fd: int, bufs: list[memoryview], offset: int) -> int:
    """``preadv`` into ``bufs`` from ``offset`` until they are full or the file ends."""
    want = sum(b.nbytes for b in bufs)
    got = os.preadv(fd, bufs, offset)
    while 0 < got < want:
        more = os.preadv(fd, _skip(bufs, got), offset + got)
        if more == 0:
            break
        got += more
    return got


def _skip(bufs: list[memoryview], n: int) -> list[memoryview]:
    out = []
    for b in bufs:
        if n >= b.nbytes:
            n -= b.nbytes
            continue
        out.append(b[n:])
        n = 0
    return out


def _read_hashing(fd: int, head: memoryview, parts: list[memoryview], h) -> tuple[int, bool]:
    """Read ``head`` then ``parts`` from the file's start, feeding each group of parts to the
    hash ``h`` right after its ``preadv`` (while the bytes are still in the CPU cache, which
    makes checking them cheap). Returns (bytes read, whether the file goes on past them); ``h``
    has seen all of ``parts`` only when all of them were read."""
    bufs = [head, *parts]
    off = i = 0
    while i < len(bufs):
        j, nbytes = i, 0
        while j < len(bufs) and j - i < _IOV_MAX and (j == i or nbytes < _GROUP_BYTES):
            nbytes += bufs[j].nbytes
            j += 1
        got = _fill(fd, bufs[i:j], off)
        off += got
        if got < nbytes:
            return off, False
        for b in bufs[max(i, 1) : j]:
            h.update(b)
        i = j
    return off, bool(os.pread(fd, 1, off))


#: How :func:`check_block` begins its answer for a block of another KV layout (not damaged).
OTHER_LAYOUT = "written with KV layout"


def block_header(
    mac_key: bytes | None,
    namespace: str,
    key: str,
    rank: int,
    fingerprint: str,
    parts: Sequence[memoryview],
) -> bytes:
    """The bytes that go before a block's payload ``parts``: the header, with the payload's
    xxh3-64 (``mac_key`` None) or followed by its keyed MAC."""
    length = sum(p.nbytes for p in parts)
    fp16 = fp16_of(fingerprint)
    if mac_key is None:
        algo, digest, mac = CHECKSUM_XXH3_64, checksum(parts), b""
    else:
        h = _block_mac(mac_key, namespace, key, rank, fp16, length)
        for p in parts:
            h.update(p)
        algo, digest, mac = MAC_BLAKE3_KEYED, 0, h.digest()
    return _HEADER.pack(MAGIC, FORMAT, algo, length, digest, fp16, bytes.fromhex(key)) + mac


def payload_hash(
    mac_key: bytes | None, namespace: str, key: str, rank: int, fp16: bytes, size: int
):
    """What :func:`check_block` needs fed with the payload: an xxh3-64, or the keyed MAC of
    the block named by these (``size`` payload bytes expected)."""
    if mac_key is None:
        return xxhash.xxh3_64()
    return _block_mac(mac_key, namespace, key, rank, fp16, size)


def check_header(head, key: str, fp16: bytes, size: int, algo: int) -> str | None:
    """Why a block whose header is ``head`` must not be used, or None when it may (its
    payload still to be checked: :func:`check_payload`): its format, algorithm (``algo``: the
    one the reader writes), key, KV layout (``fp16``) and payload length (``size``)."""
    magic, fmt, got_algo, length, _, fp, k = _HEADER.unpack_from(head)
    if magic != MAGIC or fmt != FORMAT:
        return f"unknown format {magic!r}/{fmt}"
    if got_algo != algo:
        if got_algo == MAC_BLAKE3_KEYED:
            return "written with a fleet key (MAC) and we have none"
        if got_algo == CHECKSUM_XXH3_64:
            return "no MAC (written without the fleet key, or forged)"
        return f"unknown checksum algorithm {got_algo}"
    if k != bytes.fromhex(key):
        return "key differs from its name"
    if fp != fp16:
        return f"{OTHER_LAYOUT} {fp!r}"
    if length != size:
        return f"{length} payload bytes, expected {size}"
    return None


def check_payload(head, h) -> str | None:
    """Why a block whose header (and MAC) is ``head``, passed by :func:`check_header`, and
    whose whole payload was fed to ``h`` (:func:`payload_hash`) must not be used, or None."""
    digest = _HEADER.unpack_from(head)[4]
    if isinstance(h, xxhash.xxh3_64):
        return None if h.intdigest() == digest else "checksum mismatch"
    if digest != 0:
        return "a checksum field in a block with a MAC"
    if not hmac.compare_digest(h.digest(), bytes(head[HEADER_BYTES : HEADER_BYTES + MAC_BYTES])):
        return "MAC mismatch (forged, damaged, or another block's)"
    return None


class DiscardLog:
    """Counts blocks discarded for failing their checks; :meth:`tell` says whether to warn
    now (at most once per :data:`LOG_EVERY_S`) and how many were discarded since the last
    warning (whoever can write a tier can make reads fail at will: one line, not one each)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._throttle = Throttle(LOG_EVERY_S, clock=clock)
        self._count = 0
        self._lock = threading.Lock()

    def tell(self) -> int:
        """Count one; the count to warn about now, or 0 when not to warn yet."""
        with self._lock:
            self._count += 1
            if not self._throttle.ready():
                return 0
            n, self._count = self._count, 0
            return n


class FileStore:
    """Block files under ``root/<namespace>/``; one instance per tier and process.

    ``key`` is the fleet key: with it, files are written with and read only with a valid
    MAC (see the module's docstring); without it, with and only with an xxh3-64 checksum.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        namespace: str,
        *,
        fsync: bool = False,
        key: bytes | None = None,
    ) -> None:
        self.dir = Path(root) / namespace
        self.namespace = namespace
        self.fsync = fsync
        self._mac_key = mac_key(key) if key is not None else None
        self.algo = CHECKSUM_XXH3_64 if key is None else MAC_BLAKE3_KEYED
        #: Bytes before the payload: the header, and the MAC when keyed.
        self.header_bytes = HEADER_BYTES + (MAC_BYTES if key is not None else 0)
        self._discards = DiscardLog()
        Path(root).mkdir(parents=True, exist_ok=True)
        own_dir(self.dir)
        self._dir = str(self.dir)
        self._fps: dict[str, bytes] = {}
        #: Subdirectories checked by ``own_dir`` (at most 256: the keys' first two hex digits).
        self._owned: set[Path] = set()

    @property
    def keyed(self) -> bool:
        """Whether block files carry a MAC (a fleet key was given)."""
        return self._mac_key is not None

    def path(self, key: str, rank: int = 0) -> Path:
        return self.dir / key[:2] / f"{key}.r{rank}"

    def exists(self, key: str, ranks: int = 1) -> bool:
        """True when every TP rank's file of ``key`` is in place (complete by construction)."""
        return all(self.path(key, r).is_file() for r in range(ranks))

    def write(self, key: str, payload, fingerprint: str, rank: int = 0) -> int:
        """Write one block atomically; returns the bytes written. Raises ``OSError``.

        ``payload`` is one buffer or a sequence of buffers (a block's pieces, in order).
        """
        final = self.path(key, rank)
        if final.parent not in self._owned:
            own_dir(final.parent)
            self._owned.add(final.parent)
        tmp = final.parent / f".{final.name}.{os.urandom(8).hex()}.tmp"
        parts = byte_views(payload)
        header = block_header(self._mac_key, self.namespace, key, rank, fingerprint, parts)
        try:
            with os.fdopen(os.open(tmp, _CREATE, 0o600), "wb") as f:
                f.write(header)
                for p in parts:
                    f.write(p)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return len(header) + sum(p.nbytes for p in parts)

    def read_into(self, key: str, out, fingerprint: str, rank: int = 0) -> int:
        """Read and verify one block into ``out``; returns the bytes read.

        ``out`` is one buffer or a sequence of buffers (a block's pieces where they live, in
        the order they were written) whose sizes add up to the payload's: ``preadv`` fills
        them (no intermediate copy), each group hashed as soon as it landed. A file this
        store cannot check (keyed without a key, unkeyed with one) or whose checksum or MAC
        fails is wrong. ``FileNotFoundError`` when the block is not there;
        :class:`BlockFileError` when the file is there but wrong (the file is then deleted so
        nobody trips on it again, except a block of another KV layout). On any error ``out``
        holds garbage: never use it.
        """
        path = f"{self._dir}/{key[:2]}/{key}.r{rank}"  # self.path(), without pathlib's cost
        parts = byte_views(out)
        size = sum(p.nbytes for p in parts)
        head_bytes = self.header_bytes
        head = bytearray(head_bytes)
        ours = self._fps.get(fingerprint)
        if ours is None:
            ours = self._fps[fingerprint] = fp16_of(fingerprint)
        h = payload_hash(self._mac_key, self.namespace, key, rank, ours, size)
        try:
            fd = os.open(path, _OPEN_READ)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                self._discard(path, "a symbolic link, not a block file")
            raise
        try:
            got, longer = _read_hashing(fd, memoryview(head), parts, h)
        finally:
            os.close(fd)
        if got < HEADER_BYTES:
            self._discard(path, "truncated header")
        why = check_header(head, key, ours, size, self.algo)
        if why is not None and why.startswith(OTHER_LAYOUT):
            raise BlockFileError(f"{path}: {why}, ours {fingerprint}")
        if why is None and (got != head_bytes + size or longer):
            why = f"payload of {got - head_bytes}{'+' if longer else ''} bytes"
            why += f", expected exactly {size}"
        if why is None:
            why = check_payload(head, h)
        if why is not None:
            self._discard(path, why)
        return head_bytes + size

    def _discard(self, path: str | Path, why: str) -> NoReturn:
        """Delete the file at ``path`` and raise :class:`BlockFileError`; warn at most once
        per :data:`LOG_EVERY_S` (with how many files were discarded since)."""
        Path(path).unlink(missing_ok=True)
        n = self._discards.tell()
        if n:
            logger.warning(
                "KV block file %s failed its checks (%s): deleted, the block is recomputed "
                "(%d such file%s in this tier since the last warning)",
                path,
                why,
                n,
                "" if n == 1 else "s",
            )
        raise BlockFileError(f"{path}: {why}")

    def delete(self, key: str, ranks: int = 1) -> None:
        for r in range(ranks):
            self.path(key, r).unlink(missing_ok=True)

    def scan(self) -> list[str]:
        """Keys with a rank-0 file, oldest first; deletes stale temporary files."""
        found: list[tuple[float, str]] = []
        now = time.time()
        for sub in self.dir.iterdir() if self.dir.is_dir() else ():
            if not sub.is_dir():
                continue
            for p in sub.iterdir():
                try:
                    st = p.stat()
                except OSError:
                    continue
                if p.name.startswith("."):
                    if p.name.endswith(".tmp") and now - st.st_mtime > STALE_TMP_S:
                        p.unlink(missing_ok=True)
                    continue
                if p.name.endswith(".r0"):
                    found.append((st.st_mtime, p.name[:-3]))
        return [k for _, k in sorted(found)]

    def clear(self) -> None:
        """Delete every block file of this namespace (not the directory)."""
        for key in self.scan():
            for p in self.path(key).parent.glob(f"{key}.r*"):
                p.unlink(missing_ok=True)


class DirQuota:
    """Keeps the block files of one :class:`FileStore` directory within ``capacity_bytes``.

    Meant for the shared tier, which every instance of a fleet writes and nobody else
    cleans: each instance runs one. :meth:`maybe_enforce` (cheap; call it when saving) starts,
    at most every ``interval_s`` and never twice at once, a pass on a thread of its own that
    sums the sizes of the directory's block files and, over ``capacity_bytes``, deletes the
    oldest (by modification time) until ``low_water`` of it is left. Passes of several
    instances may overlap: a file deleted twice is deleted once, and a reader that finds a
    block gone has a miss. ``evicted`` counts the files this instance deleted.
    """

    def __init__(
        self,
        store: FileStore,
        capacity_bytes: int,
        *,
        interval_s: float = 30.0,
        low_water: float = 0.9,
        clock=time.monotonic,
    ) -> None:
        self.store, self.capacity_bytes = store, capacity_bytes
        self.interval_s, self.low_water = interval_s, low_water
        self._clock = clock
        self._last = float("-inf")
        self._running = threading.Lock()
        self.evicted = 0
        self.passes = 0

    def maybe_enforce(self) -> bool:
        """Start a pass if one is due and none runs; True if one was started."""
        now = self._clock()
        if now - self._last < self.interval_s or not self._running.acquire(blocking=False):
            return False
        self._last = now

        def run() -> None:
            try:
                self.enforce()
            except OSError as e:
                logger.warning("shared KV tier quota pass failed: %s", e)
            finally:
                self._running.release()

        threading.Thread(target=run, name="pdext-flexkv-quota", daemon=True).start()
        return True

    def enforce(self) -> int:
        """One pass (in the calling thread); returns the number of files deleted."""
        files: list[tuple[float, int, str]] = []
        for sub in os.scandir(self.store.dir) if self.store.dir.is_dir() else ():
            if not sub.is_dir(follow_symlinks=False):
                continue
            with os.scandir(sub.path) as entries:
                for entry in entries:
                    if entry.name.startswith(".") or ".r" not in entry.name:
                        continue
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    files.append((st.st_mtime, st.st_size, entry.path))
        total = sum(size for _, size, _ in files)
        self.passes += 1
        if total <= self.capacity_bytes:
            return 0
        target = int(self.capacity_bytes * self.low_water)
        deleted = 0
        for _, size, path in sorted(files):
            if total <= target:
                break
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                deleted += 1
            total -= size
        self.evicted += deleted
        logger.info(
            "shared KV tier over its %d bytes: deleted the %d oldest block files",
            self.capacity_bytes,
            deleted,
        )
        return deleted
