"""The remote tier: KV blocks in a Mooncake Store that every instance of a fleet reaches.

`Mooncake Store <https://github.com/kvcache-ai/Mooncake>`_ keeps objects in memory segments
that its clients contribute (``segment_gb`` each) and a master (``mooncake_master``) that
knows where each object lives; any client gets any object over the transfer engine (TCP
here, RDMA where the hardware has it). So a block one instance saved is loadable by every
other instance with the same model and block size, on any host, for as long as the master
keeps it (it evicts the oldest objects when the segments fill, and an object lives in the
segment of one client: when that instance stops, its share is gone; both are misses).

Objects are named ``pdext/<format>/<namespace>/<block key>.r<rank>`` and hold exactly what
a block file holds (:mod:`~vllm_pd_ext.connectors.flexkv.store`): the header, the keyed MAC
when the fleet key is set (else an xxh3-64), the payload. A store reaches the master and the
other clients without authentication, so whoever reaches them can put any object under any
name: a block is used only when its header, length and MAC (or checksum) check out; any
other object is a miss, removed (unless a reader holds it: the store refuses then) and
replaced when the block is saved again (a block of another KV layout is left).
Without a fleet key nothing proves who wrote a block: run the remote tier with one unless
the store's network is yours alone. The store's clients listen on ``local_hostname``; keep
it and the master on a private network.

Calls block (RPCs to the master, transfers to the client holding the object); the worker
makes them on its I/O threads, and the scheduler asks the master once per lookup for the
whole run of keys (:meth:`MooncakeBlockStore.exists_many`). A store that stops answering
(its master gone: each call then takes seconds to fail) must not stall the engine: the first
failed call marks it down, and until a background probe finds it again (after 1 s, then twice
as long each time, at most :data:`PROBE_MAX_S`) every block of the tier is a miss and no call
is made; counted in ``vllm:pdext_flexkv_remote_down_total`` and logged. Its clients reconnect
to a restarted master by themselves (the objects the old one knew are gone: misses). A master
that does not answer when the instance starts (a client's set-up would wait 90 s, then fail)
leaves the tier down from the start, the engine serving; the probe sets the client up once
the master answers.

A worker's client reads a load's blocks with one ``batch_get_into`` into a staging buffer
it registered with the store (:data:`STAGE_BYTES`, one load at a time), then checks and
copies each block from there: no Python ``bytes`` per block. When registration fails
(logged once), when the buffer is in use by another load, or for the blocks that do not
fit, the reads go through ``get_batch`` as before; the checks are the same either way.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NoReturn

from vllm_pd_ext.connectors.flexkv.config import RemoteTierConfig
from vllm_pd_ext.connectors.flexkv.keys import FORMAT
from vllm_pd_ext.connectors.flexkv.stats import FlexKVRecorder
from vllm_pd_ext.connectors.flexkv.store import (
    CHECKSUM_XXH3_64,
    HEADER_BYTES,
    MAC_BLAKE3_KEYED,
    MAC_BYTES,
    OTHER_LAYOUT,
    BlockFileError,
    DiscardLog,
    block_header,
    byte_views,
    check_header,
    check_payload,
    fp16_of,
    mac_key,
    payload_hash,
)

logger = logging.getLogger(__name__)

MiB = 1 << 20
#: Keys asked about in one ``batch_is_exist`` call, at most.
EXISTS_BATCH = 1024
#: What the store answers for a call it could not make (the master unreachable).
RPC_FAILED = -900
#: Seconds before the first probe of a store marked down, and the longest wait between two.
PROBE_FIRST_S = 1.0
PROBE_MAX_S = 30.0
#: What the store answers for an object it does not hold.
OBJECT_NOT_FOUND = -704
#: Bytes of the staging buffer a worker's client registers for batched reads.
STAGE_BYTES = 16 * MiB

_stage_warned = threading.Event()


class RemoteStoreError(OSError):
    """The store refused or failed a call (the block is then a miss)."""


class MooncakeBlockStore:
    """Blocks in a Mooncake Store: the remote tier's
    :class:`~vllm_pd_ext.connectors.flexkv.remote_base.RemoteBlockStore` (the scheduler and
    the worker call nothing else), plus :class:`~.store.FileStore`'s ``exists`` and ``delete``.

    ``segment`` False: a client that contributes no memory (the scheduler's, which only
    asks what exists). ``key``: the fleet key (blocks then carry a MAC). ``stats``: where
    the times the store went down are counted.
    """

    def __init__(
        self,
        cfg: RemoteTierConfig,
        namespace: str,
        *,
        key: bytes | None = None,
        segment: bool = True,
        stats: FlexKVRecorder | None = None,
    ) -> None:
        self.namespace = namespace
        self.master = cfg.master
        self._stats = stats
        self._up = True
        self._closed = threading.Event()
        self._prefix = f"pdext/{FORMAT}/{namespace}/"
        self._mac_key = mac_key(key) if key is not None else None
        self.algo = CHECKSUM_XXH3_64 if key is None else MAC_BLAKE3_KEYED
        self.header_bytes = HEADER_BYTES + (MAC_BYTES if key is not None else 0)
        self._discards = DiscardLog()
        self._lock = threading.Lock()
        self._cfg = cfg
        self._segment = segment
        self._store: Any = None
        self._stage: Any = None  # a registered numpy buffer, else None
        self._stage_lock = threading.Lock()
        #: Blocks got through the registered staging buffer (``batch_get_into``).
        self.staged_reads = 0
        if _reachable(cfg.master):
            self._store = self._setup()
            if self._store is None:
                raise RemoteStoreError(
                    f"Mooncake Store at {cfg.master} (metadata {cfg.metadata_server}) "
                    "refused this client"
                )
        else:  # its client would wait 90 s at setup: the tier starts down instead
            self._up = False
            if stats is not None:
                stats.add("remote_down")
            logger.warning(
                "tiered KV cache: the remote tier's master %s does not answer; its blocks are "
                "misses until it does (vllm:pdext_flexkv_remote_down_total)",
                cfg.master,
            )
            threading.Thread(target=self._probe, name="flexkv-remote-probe", daemon=True).start()

    def _setup(self) -> Any:
        """A store client set up with the config; None when the store refused it."""
        from mooncake.store import MooncakeDistributedStore

        cfg = self._cfg
        store: Any = MooncakeDistributedStore()
        rc = store.setup(
            {
                "local_hostname": cfg.local_hostname,
                "metadata_server": cfg.metadata_server,
                "global_segment_size": int(cfg.segment_gb * (1 << 30)) if self._segment else 0,
                "local_buffer_size": cfg.buffer_mb * MiB,
                "protocol": cfg.protocol,
                "master_server_addr": cfg.master,
            }
        )
        if rc != 0:
            return None
        if self._segment:
            self._register_stage(store)
        return store

    def _register_stage(self, store: Any) -> None:
        """Register a staging buffer for batched reads with ``store``; without it (logged
        once per process) reads go through ``get_batch``."""
        import numpy as np

        stage = np.empty(STAGE_BYTES, dtype=np.uint8)
        try:
            rc = store.register_buffer(stage.ctypes.data, stage.nbytes)
        except Exception as e:
            rc = f"raised {e}"
        if rc == 0:
            self._stage = stage
            return
        if not _stage_warned.is_set():
            _stage_warned.set()
            logger.warning(
                "tiered KV cache: the remote tier's store refused a registered buffer (%s); "
                "reads copy through Python bytes instead",
                rc,
            )

    @property
    def keyed(self) -> bool:
        """Whether blocks carry a MAC (a fleet key was given)."""
        return self._mac_key is not None

    def name(self, key: str, rank: int = 0) -> str:
        """The object name of block ``key``'s rank ``rank``."""
        return f"{self._prefix}{key}.r{rank}"

    def exists(self, key: str, ranks: int = 1) -> bool:
        """True when every TP rank's object of ``key`` is in the store."""
        return self.exists_many([key], ranks)[0]

    def exists_many(self, keys: Sequence[str], ranks: int = 1) -> list[bool]:
        """For each of ``keys``, whether every TP rank's object is in the store (one call to
        the master per :data:`EXISTS_BATCH` names); a failed call says False."""
        names = [self.name(k, r) for k in keys for r in range(ranks)]
        found: list[int] = []
        for i in range(0, len(names), EXISTS_BATCH):
            batch = names[i : i + EXISTS_BATCH]
            got: list[int] = []
            if self._up:
                try:
                    got = list(self._store.batch_is_exist(batch))
                except Exception as e:  # a store failure is a miss
                    self._down(f"batch_is_exist raised {e}")
                if any(x < 0 for x in got):
                    self._down(f"batch_is_exist answered {min(got)}")
            found.extend(got if len(got) == len(batch) else [0] * len(batch))
        return [all(x == 1 for x in found[i * ranks : (i + 1) * ranks]) for i in range(len(keys))]

    @property
    def up(self) -> bool:
        """Whether the store is answering (else every block is a miss, no call made)."""
        return self._up

    def _down(self, why: str) -> None:
        """A call failed: the store is down until :meth:`_probe` finds it again."""
        with self._lock:
            if not self._up or self._closed.is_set():
                return
            self._up = False
        if self._stats is not None:
            self._stats.add("remote_down")
        logger.warning(
            "tiered KV cache: the remote tier's store (master %s) stopped answering (%s); its "
            "blocks are misses until it answers again (vllm:pdext_flexkv_remote_down_total)",
            self.master,
            why,
        )
        threading.Thread(target=self._probe, name="flexkv-remote-probe", daemon=True).start()

    def _probe(self) -> None:
        """Ask the store about one name, after a back-off, until it answers; then up again."""
        wait = PROBE_FIRST_S
        while not self._closed.wait(wait):
            if self._store is None:  # never set up: the master did not answer at start
                if _reachable(self.master):
                    self._store = self._setup()
                ok = self._store is not None
            else:
                try:
                    probe = self._store.batch_is_exist([self._prefix + "probe"])
                    ok = all(x >= 0 for x in probe)
                except Exception:  # still down
                    ok = False
            if ok:
                self._up = True
                logger.warning(
                    "tiered KV cache: the remote tier's store (master %s) answers again",
                    self.master,
                )
                return
            wait = min(2 * wait, PROBE_MAX_S)

    def write(self, key: str, payload, fingerprint: str, rank: int = 0) -> int:
        """Put one block, replacing any object under its name (one that failed the checks:
        a plain put would keep it); returns the bytes put. Raises :class:`RemoteStoreError`."""
        name = self.name(key, rank)
        parts = byte_views(payload)
        header = block_header(self._mac_key, self.namespace, key, rank, fingerprint, parts)
        if not self._up:
            raise RemoteStoreError(f"put of {name}: the store is down")
        rc = self._store.upsert_parts(name, header, *parts)
        if rc == RPC_FAILED:
            self._down(f"a put answered {rc}")
        if rc != 0:
            raise RemoteStoreError(f"put of {name} failed: {rc}")
        return len(header) + sum(p.nbytes for p in parts)

    def fetch_many(self, keys: Sequence[str], rank: int = 0) -> dict[str, bytes]:
        """The objects of ``keys`` (rank ``rank``) in one call to the store (``b""`` for a
        missing one; every one of them when the store is down or the call fails), for
        :meth:`check_into`."""
        if not self._up or not keys:
            return {}
        try:
            got = self._store.get_batch([self.name(k, rank) for k in keys])
        except Exception as e:  # a store failure is a miss
            self._down(f"get_batch raised {e}")
            return {}
        if len(got) != len(keys):
            return {}
        return dict(zip(keys, got, strict=True))

    @contextlib.contextmanager
    def fetching(
        self, sizes: Mapping[str, int], rank: int = 0
    ) -> Iterator[Mapping[str, bytes | memoryview]]:
        """:meth:`fetch_many` of the keys of ``sizes`` (each block's payload bytes), through
        the registered staging buffer when there is one and no other load holds it: the
        objects are views into it, valid only inside the ``with``."""
        if self._stage is None or not sizes or not self._stage_lock.acquire(blocking=False):
            yield self.fetch_many(list(sizes), rank)
            return
        try:
            yield self._fetch_staged(sizes, rank)
        finally:
            self._stage_lock.release()

    def _fetch_staged(
        self, sizes: Mapping[str, int], rank: int
    ) -> Mapping[str, bytes | memoryview]:
        """The objects of ``sizes``' keys: those that fit in one ``batch_get_into`` into the
        staging buffer, the rest (and any that does not fit its slot: too long, so its checks
        see it whole) through :meth:`fetch_many`."""
        if not self._up:
            return {}
        base, room = self._stage.ctypes.data, self._stage.nbytes
        staged: list[str] = []
        offsets: list[int] = []
        lengths: list[int] = []
        off = 0
        for key, size in sizes.items():
            n = self.header_bytes + size
            if off + n > room:
                break
            staged.append(key)
            offsets.append(off)
            lengths.append(n)
            off += n
        if not staged:
            return self.fetch_many(list(sizes), rank)
        try:
            got = list(
                self._store.batch_get_into(
                    [self.name(k, rank) for k in staged], [base + o for o in offsets], lengths
                )
            )
        except Exception as e:  # a store failure is a miss
            self._down(f"batch_get_into raised {e}")
            return {}
        if RPC_FAILED in got:
            self._down(f"batch_get_into answered {RPC_FAILED}")
        if len(got) != len(staged) or RPC_FAILED in got:
            return {}
        view = memoryview(self._stage)
        out: dict[str, bytes | memoryview] = {}
        rest = list(sizes)[len(staged) :]
        for key, o, rc in zip(staged, offsets, got, strict=True):
            if rc >= 0:
                out[key] = view[o : o + rc]
                self.staged_reads += 1
            elif rc == OBJECT_NOT_FOUND:
                out[key] = b""
            else:
                rest.append(key)
        out.update(self.fetch_many(rest, rank))
        return out

    def read_into(self, key: str, out, fingerprint: str, rank: int = 0) -> int:
        """Get and verify one block into ``out`` (one buffer or the block's pieces, in
        order); returns the bytes got. ``FileNotFoundError`` when the store has no such
        object; :class:`~.store.BlockFileError` when it has one that fails the checks (it is
        then removed, except a block of another KV layout). On any error ``out`` holds
        garbage: never use it."""
        name = self.name(key, rank)
        if not self._up:
            raise RemoteStoreError(f"get of {name}: the store is down")
        try:
            raw = self._store.get(name)
        except Exception as e:  # a store failure is a miss
            self._down(f"get raised {e}")
            raise RemoteStoreError(f"get of {name} failed: {e}") from e
        return self.check_into(key, raw, out, fingerprint, rank)

    def check_into(
        self, key: str, raw: bytes | memoryview, out, fingerprint: str, rank: int = 0
    ) -> int:
        """:meth:`read_into` for an object already got (``raw``, from :meth:`fetch_many` or
        :meth:`fetching`)."""
        name = self.name(key, rank)
        parts = byte_views(out)
        size = sum(p.nbytes for p in parts)
        if not raw:
            raise FileNotFoundError(name)
        view = memoryview(raw)
        if len(view) < self.header_bytes:
            self._discard(name, "truncated header")
        head = view[: self.header_bytes]
        fp16 = fp16_of(fingerprint)
        why = check_header(head, key, fp16, size, self.algo)
        if why is not None and why.startswith(OTHER_LAYOUT):
            raise BlockFileError(f"{name}: {why}, ours {fingerprint}")
        if why is None and len(view) != self.header_bytes + size:
            why = f"payload of {len(view) - self.header_bytes} bytes, expected exactly {size}"
        if why is None:
            h = payload_hash(self._mac_key, self.namespace, key, rank, fp16, size)
            off = self.header_bytes
            for p in parts:
                chunk = view[off : off + p.nbytes]
                h.update(chunk)
                p[:] = chunk
                off += p.nbytes
            why = check_payload(head, h)
        if why is not None:
            self._discard(name, why)
        return self.header_bytes + size

    def _discard(self, name: str, why: str) -> NoReturn:
        """Remove the object ``name`` (the store refuses while a reader holds it; the block's
        next save replaces it) and raise :class:`~.store.BlockFileError`; warn at most once
        per :data:`~.store.LOG_EVERY_S`."""
        with contextlib.suppress(Exception):  # leased or gone: a miss either way
            self._store.remove(name)
        n = self._discards.tell()
        if n:
            logger.warning(
                "KV block %s in the remote tier failed its checks (%s): not used, the block is "
                "recomputed and saved over it (%d such block%s since the last warning)",
                name,
                why,
                n,
                "" if n == 1 else "s",
            )
        raise BlockFileError(f"{name}: {why}")

    def delete(self, key: str, ranks: int = 1) -> None:
        for r in range(ranks):
            with contextlib.suppress(Exception):  # leased or gone: the master evicts it
                self._store.remove(self.name(key, r))

    def close(self) -> None:
        self._closed.set()
        if self._store is None:
            return
        try:
            with self._stage_lock:
                if self._stage is not None:
                    self._store.unregister_buffer(self._stage.ctypes.data)
            self._store.close()
        except Exception:
            logger.debug("remote tier: close failed", exc_info=True)


def _reachable(master: str, timeout_s: float = 2.0) -> bool:
    """Whether ``master`` (host:port) accepts a TCP connection within ``timeout_s``."""
    host, _, port = master.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False
