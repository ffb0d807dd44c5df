"""Block files of the SSD and shared tiers: one file per block and TP rank.

A file is a fixed header (magic, format, payload length, CRC-32 of the payload, the KV
layout fingerprint, the block key) followed by the block's bytes. Writes go to a hidden
temporary file in the same directory and are renamed into place only when complete, so a
crash mid-save leaves no file under the block's name (at most a temporary that
:meth:`FileStore.scan` deletes later). Reads check every header field and the checksum;
any difference raises :class:`BlockFileError`, and the caller treats the block as missing.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
import zlib
from pathlib import Path

from vllm_pd_ext.connectors.flexkv.keys import FORMAT

logger = logging.getLogger(__name__)

MAGIC = b"PDEXTKV\x00"
_HEADER = struct.Struct("<8sIQI16s16s")  # magic, format, payload len, crc32, layout fp, key
HEADER_BYTES = _HEADER.size
#: Temporary files older than this are leftovers of a crash and are deleted by scan().
STALE_TMP_S = 600.0


class BlockFileError(RuntimeError):
    """A block file exists but cannot be trusted (truncated, corrupt, other layout)."""


def _fp16(fingerprint: str) -> bytes:
    return fingerprint.encode()[:16].ljust(16, b"\0")


class FileStore:
    """Block files under ``root/<namespace>/``; one instance per tier and process."""

    def __init__(self, root: str | os.PathLike, namespace: str, *, fsync: bool = False) -> None:
        self.dir = Path(root) / namespace
        self.fsync = fsync
        self.dir.mkdir(parents=True, exist_ok=True)

    def path(self, key: str, rank: int = 0) -> Path:
        return self.dir / key[:2] / f"{key}.r{rank}"

    def exists(self, key: str, ranks: int = 1) -> bool:
        """True when every TP rank's file of ``key`` is in place (complete by construction)."""
        return all(self.path(key, r).is_file() for r in range(ranks))

    def write(self, key: str, payload: memoryview, fingerprint: str, rank: int = 0) -> int:
        """Write one block atomically; returns the bytes written. Raises ``OSError``."""
        final = self.path(key, rank)
        final.parent.mkdir(exist_ok=True)
        tmp = final.parent / f".{final.name}.{os.getpid()}.{threading.get_ident()}.tmp"
        mv = memoryview(payload).cast("B")
        header = _HEADER.pack(
            MAGIC, FORMAT, mv.nbytes, zlib.crc32(mv), _fp16(fingerprint), bytes.fromhex(key)
        )
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(mv)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return HEADER_BYTES + mv.nbytes

    def read_into(self, key: str, out: memoryview, fingerprint: str, rank: int = 0) -> int:
        """Read and verify one block into ``out`` (exactly its size); returns bytes read.

        ``FileNotFoundError`` when the block is not there; :class:`BlockFileError` when the
        file is there but wrong (the file is then deleted so nobody trips on it again).
        """
        path = self.path(key, rank)
        mv = memoryview(out).cast("B")
        with open(path, "rb", buffering=0) as f:
            head = f.read(HEADER_BYTES)
            try:
                magic, fmt, length, crc, fp, k = _HEADER.unpack(head)
            except struct.error:
                self._discard(path, "truncated header")
            if magic != MAGIC or fmt != FORMAT:
                self._discard(path, f"unknown format {magic!r}/{fmt}")
            if k != bytes.fromhex(key):
                self._discard(path, "key differs from its file name")
            if fp != _fp16(fingerprint):
                raise BlockFileError(f"{path}: written with KV layout {fp!r}, ours {fingerprint}")
            if length != mv.nbytes:
                self._discard(path, f"{length} payload bytes, expected {mv.nbytes}")
            got = f.readinto(mv)
            if got != mv.nbytes or f.read(1):
                self._discard(path, f"payload of {got} bytes, expected exactly {mv.nbytes}")
        if zlib.crc32(mv) != crc:
            self._discard(path, "checksum mismatch")
        return HEADER_BYTES + mv.nbytes

    def _discard(self, path: Path, why: str):
        logger.warning("corrupt KV block file %s (%s): deleted, the block is recomputed", path, why)
        path.unlink(missing_ok=True)
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
