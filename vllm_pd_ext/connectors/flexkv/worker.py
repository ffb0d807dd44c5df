"""Worker side of the tiered KV cache (runs in each vLLM worker process).

Holds the CPU tier (a :class:`~vllm_pd_ext.connectors.flexkv.copier.BlockCopier`: one
``[slots, block_bytes]`` byte tensor, pinned when a GPU is present, copies on a side stream)
and moves blocks between vLLM's KV cache tensors, that pool and block files:

* saves leave the engine step at once: ``wait_for_save`` hands the step's completed blocks
  to one save thread, which copies them into their CPU pool rows and, for blocks that also
  go to files, into a private row tensor whose file writes (checksums, writes) it queues to a
  bounded I/O pool (when the queue is full a write is dropped and counted, never awaited).
  The blocks are read after the step, so they must stay put until the copy ends: a finished
  request's blocks are held by vLLM until ``get_finished`` reports it in ``finished_sending``
  (the scheduler side returned True from ``request_finished``), and ``handle_preemptions``
  waits for the copies of requests preempted in this step before the forward pass may
  overwrite their blocks;
* loads of hits wholly in the CPU tier are synchronous (the scheduler said so): they run in
  ``start_load_kv``, before the forward pass of the step that computes the rest of the
  prompt. Other loads run on a small thread pool and report the request in
  ``finished_recving``: CPU rows are copied into the request's blocks; block files are read
  by the I/O pool with one ``preadv`` each straight into the block's pieces in the cache (on
  CPU caches; through pinned rows on GPUs), checked (xxh3-64, or a keyed MAC when a fleet key
  is set: see :mod:`~vllm_pd_ext.connectors.flexkv.store`) and promoted into the CPU rows
  the scheduler reserved. Blocks that could not be read (missing, corrupt, other layout) are
  reported through ``get_block_ids_with_load_errors()`` in the same pass, so vLLM's
  ``kv_load_failure_policy`` recomputes or fails them; their bytes are never used. A load
  first waits for pending saves of the CPU rows it reads or promotes into.

Block bytes are addressed through :func:`~vllm_pd_ext.connectors.flexkv.blocks.block_views`
(the shared KV layout of ``connectors/common/layout.py``), so any attention backend whose
blocks are a fixed set of byte pieces works.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

import torch

from vllm_pd_ext import fleet_key
from vllm_pd_ext.connectors.flexkv.blocks import group_block_views
from vllm_pd_ext.connectors.flexkv.config import FlexKVConfig
from vllm_pd_ext.connectors.flexkv.copier import STAGE_BYTES, BlockCopier
from vllm_pd_ext.connectors.flexkv.metadata import (
    CPU,
    REMOTE,
    SHARED,
    SSD,
    FlexKVMetadata,
    LoadItem,
    LoadJob,
    SaveItem,
)
from vllm_pd_ext.connectors.flexkv.remote import MooncakeBlockStore
from vllm_pd_ext.connectors.flexkv.remote_base import RemoteBlockStore
from vllm_pd_ext.connectors.flexkv.stats import FlexKVRecorder
from vllm_pd_ext.connectors.flexkv.store import BlockFileError, FileStore

logger = logging.getLogger(__name__)


class FlexKVWorker:
    """Worker-side state; public methods run on vLLM's worker thread."""

    def __init__(
        self,
        cfg: FlexKVConfig,
        *,
        namespace: str,
        num_blocks: int,
        block_size: int,
        model: Mapping[str, Any],
        cpu_slots: int,
        tp_rank: int = 0,
        block_sizes: Sequence[int] = (),
        group_of: Mapping[str, int] | None = None,
    ) -> None:
        """``block_sizes`` and ``group_of`` (layer name -> KV cache group) describe a
        hybrid model's groups; omitted, every layer is in one group of ``block_size``."""
        self.cfg = cfg
        self.namespace = namespace
        self.num_blocks, self.block_size = num_blocks, block_size
        self.block_sizes = tuple(block_sizes) or (block_size,)
        self.group_of = dict(group_of or {})
        #: One copier per KV cache group, all over one CPU tier (group 0's is ``copier``).
        self.copiers: list[BlockCopier] = []
        self._state_saves: list[Future] = []  # saves of state pages of the last step
        self.model = dict(model)
        self.cpu_slots = cpu_slots
        self.tp_rank = tp_rank
        self.stats = FlexKVRecorder()
        self.fingerprint = ""
        self.block_bytes = 0
        self.copier: BlockCopier | None = None
        self.stores: dict[str, FileStore | RemoteBlockStore] = {}
        #: The remote tier's store (also ``stores[REMOTE]``), else None.
        self.remote: RemoteBlockStore | None = None
        key = fleet_key.load_key() if cfg.ssd_dir or cfg.shared_dir or cfg.remote else None
        if cfg.ssd_dir:
            self.stores[SSD] = FileStore(cfg.ssd_dir, namespace, fsync=cfg.fsync, key=key)
        if cfg.shared_dir:
            self.stores[SHARED] = FileStore(cfg.shared_dir, namespace, fsync=cfg.fsync, key=key)
        if cfg.remote is not None:
            self.remote = MooncakeBlockStore(cfg.remote, namespace, key=key, stats=self.stats)
            self.stores[REMOTE] = self.remote
        if self.stores:
            logger.info(
                "tiered KV cache block files carry %s",
                "a keyed MAC (fleet key)" if key else "an xxh3-64 checksum (no fleet key: no MAC)",
            )
        self._io = ThreadPoolExecutor(cfg.io_threads, thread_name_prefix="flexkv-io")
        self._loader = ThreadPoolExecutor(cfg.load_threads, thread_name_prefix="flexkv-load")
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="flexkv-save")
        self._saves: dict[str, list[Future]] = {}  # req id -> its saves not yet reported
        self._finishing: set[str] = set()  # finished requests whose blocks vLLM holds for us
        self._slot_writer: dict[int, Future] = {}  # CPU pool row -> the save writing it
        self._bad_slots: set[int] = set()  # CPU rows whose save failed: never loaded
        self._pending_writes = 0
        self._meta: FlexKVMetadata | None = None
        self._loads: dict[str, Future] = {}
        self._load_errors: set[int] = set()
        self._failed_loads: set[str] = set()  # requests whose load failed (several groups)
        self._lock = threading.Lock()
        self._tls = threading.local()

    @property
    def pool(self) -> torch.Tensor | None:
        """The CPU tier: ``[slots, block_bytes]`` bytes."""
        return self.copier.pool if self.copier is not None else None

    @property
    def _blocks(self) -> BlockCopier:
        """The copier of :meth:`register_kv_caches` (vLLM registers before any step)."""
        if self.copier is None:
            raise RuntimeError("register_kv_caches() has not run")
        return self.copier

    def _copier(self, group: int) -> BlockCopier:
        """The copier of KV cache group ``group``."""
        if not self.copiers:
            raise RuntimeError("register_kv_caches() has not run")
        return self.copiers[group]

    # ---- setup ----
    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Map every block's bytes (per KV cache group) and allocate the CPU tier: one row
        per block of any group, as wide as the widest group's block."""
        views = group_block_views(
            kv_caches,
            num_blocks=self.num_blocks,
            block_sizes=self.block_sizes,
            model=self.model,
            group_of=self.group_of,
        )
        self.block_bytes = max(v.block_bytes for v in views)
        first = BlockCopier(views[0], self.cpu_slots)
        pool = first.pool
        if first.block_bytes != self.block_bytes:
            pool = first.pool = torch.empty(
                (self.cpu_slots, self.block_bytes), dtype=torch.uint8, pin_memory=first.pinned
            )
        self.copiers = [first, *(BlockCopier(v, self.cpu_slots, pool) for v in views[1:])]
        self.copier = first
        self.fingerprint = views[0].fingerprint
        logger.info(
            "tiered KV cache worker: %d KiB per block, CPU tier %d blocks (%.1f MiB%s), layout %s",
            self.block_bytes // 1024,
            self.cpu_slots,
            self.cpu_slots * self.block_bytes / (1 << 20),
            ", pinned" if self.copier.pinned else "",
            self.fingerprint,
        )

    def gather(self, block_ids: list[int], after: Any = None, group: int = 0) -> torch.Tensor:
        """Copy device blocks of KV cache group ``group`` into a new CPU tensor
        ``[len(block_ids), that group's block bytes]``."""
        copier = self._copier(group)
        out = copier.empty_rows(len(block_ids))
        copier.gather(block_ids, out, range(len(block_ids)), after)
        return out

    def scatter(
        self, block_ids: list[int], rows: torch.Tensor, picks: list[int], group: int = 0
    ) -> None:
        """Copy row ``picks[j]`` of ``rows`` (CPU, ``[m, block bytes]``) into device block
        ``block_ids[j]`` of KV cache group ``group`` for every ``j``."""
        self._copier(group).scatter(block_ids, rows, picks)

    # ---- per step ----
    def bind(self, meta: FlexKVMetadata) -> None:
        self._meta = meta

    def start_load_kv(self) -> None:
        """Run this step's synchronous loads (CPU-tier hits: done when this returns, before
        the forward pass) and start its asynchronous ones (reported by :meth:`get_finished`).
        First waits for the copies of state pages saved in the previous step (vLLM frees
        such a page two steps after it was written and may hand it to another request)."""
        if self._state_saves:
            wait_futures(self._state_saves)
            self._state_saves = []
        meta = self._meta
        if meta is None or not meta.loads:
            return
        after = self._blocks.compute_event()
        for job in meta.loads:
            slots = {it.slot for it in job.items} | {it.promote_slot for it in job.items}
            with self._lock:
                waits = [self._slot_writer[s] for s in slots if s in self._slot_writer]
            if job.sync:
                self._load_errors |= self._run_load(job, waits, after)
            else:
                self._loads[job.req_id] = self._loader.submit(self._run_load, job, waits, after)

    def wait_for_save(self) -> None:
        """Hand the step's completed blocks to the save thread; returns without copying."""
        meta, self._meta = self._meta, None
        if meta is None:
            return
        ssd = self.stores.get(SSD)
        if isinstance(ssd, FileStore):
            if meta.clear_ssd:
                self._io.submit(ssd.clear)
            for key in meta.ssd_deletes:
                self._io.submit(ssd.delete, key)
        if not meta.saves:
            return
        saves = list(meta.saves)
        fut = self._saver.submit(self._run_save, saves, self._blocks.compute_event())
        if any(s.state for s in saves):
            self._state_saves.append(fut)
        with self._lock:
            for rid in {s.req_id for s in saves}:
                self._saves.setdefault(rid, []).append(fut)
            for s in saves:
                if s.slot >= 0:
                    self._slot_writer[s.slot] = fut
        fut.add_done_callback(self._forget_slots)

    def _forget_slots(self, fut: Future) -> None:
        with self._lock:
            for slot in [k for k, f in self._slot_writer.items() if f is fut]:
                del self._slot_writer[slot]

    def _wants_file(self, s: SaveItem) -> bool:
        return any(wanted and tier in self.stores for tier, wanted in _file_tiers(s))

    def _run_save(self, saves: list[SaveItem], after: Any = None) -> None:
        """Save thread: the blocks of each KV cache group in turn (:meth:`_save_group`)."""
        for group, items in _by_group(saves).items():
            self._save_group(group, items, after)

    def _save_group(self, group: int, saves: list[SaveItem], after: Any = None) -> None:
        """Copy one group's blocks into their CPU rows and, for blocks that also go to
        files, into a private row tensor (a CPU row may be reused before its file is
        written), then queue their file writes."""
        t0 = time.perf_counter()
        copier = self._copier(group)
        nbytes = copier.block_bytes
        to_file = [s for s in saves if self._wants_file(s)]
        to_cpu = [s for s in saves if s.slot >= 0]
        try:
            rows = self.gather([s.block_id for s in to_file], after, group) if to_file else None
            direct = [s for s in to_cpu if not self._wants_file(s)]
            copier.gather(
                [s.block_id for s in direct], copier.pool, [s.slot for s in direct], after
            )
            if rows is not None:
                for j, s in enumerate(to_file):
                    if s.slot >= 0:
                        copier.pool[s.slot, :nbytes].copy_(rows[j])
        except Exception:
            # The scheduler already lists these rows as ready: make their loads fail instead.
            logger.exception("tiered KV cache: saving %d blocks failed", len(saves))
            with self._lock:
                self._bad_slots |= {s.slot for s in to_cpu}
            return
        if to_cpu:
            with self._lock:
                self._bad_slots -= {s.slot for s in to_cpu}
            self.stats.add("save_bytes", len(to_cpu) * nbytes, CPU)
            self.stats.add("save_seconds", time.perf_counter() - t0, CPU)
        if rows is None:
            return
        for j, s in enumerate(to_file):
            for tier, wanted in _file_tiers(s):
                if wanted and tier in self.stores:
                    self._queue_write(tier, s, rows[j])

    def handle_preemptions(self, meta: FlexKVMetadata) -> None:
        """Before the forward pass: wait until no save reads blocks of preempted requests."""
        with self._lock:
            futs = [f for rid in meta.preempted for f in self._saves.get(rid, ())]
        if futs:
            wait_futures(futs)

    def _queue_write(self, tier: str, item: SaveItem, row: torch.Tensor) -> None:
        with self._lock:
            if self._pending_writes >= self.cfg.max_pending_writes:
                self.stats.add("dropped_writes")
                return
            self._pending_writes += 1
        self._io.submit(self._write, tier, item.key, row)

    def _write(self, tier: str, key: str, row: torch.Tensor) -> None:
        try:
            t0 = time.perf_counter()
            n = self.stores[tier].write(key, row.numpy(), self.fingerprint, self.tp_rank)
            self.stats.add("save_bytes", n, tier)
            self.stats.add("save_seconds", time.perf_counter() - t0, tier)
        except OSError as e:
            logger.warning(
                "tiered KV cache: writing block %s to the %s tier failed: %s", key, tier, e
            )
        finally:
            with self._lock:
                self._pending_writes -= 1

    def _read(
        self, tier: str, key: str, out, fetched: Mapping[str, bytes | memoryview] | None = None
    ) -> str | None:
        """Read one block file into ``out`` (a row, or the block's pieces); None on
        success, else why it failed (``out`` then holds garbage). ``fetched``: the remote
        tier's objects of this load, got in one call (:meth:`_fetch_remote`)."""
        try:
            if tier == REMOTE and self.remote is not None and fetched is not None:
                self.remote.check_into(
                    key, fetched.get(key, b""), out, self.fingerprint, self.tp_rank
                )
            else:
                self.stores[tier].read_into(key, out, self.fingerprint, self.tp_rank)
            return None
        except BlockFileError as e:
            self.stats.add("corrupt_blocks")
            return str(e)
        except OSError as e:
            return f"{type(e).__name__}: {e}"

    def _run_load(self, job: LoadJob, waits: Sequence[Future] = (), after: Any = None) -> set[int]:
        """Load one request's blocks once the saves in ``waits`` (of the CPU rows it reads or
        promotes into) are done; returns the device block ids that failed."""
        failed: set[int] = set()
        try:
            wait_futures(waits)
            with self._lock:
                bad = set(self._bad_slots)
            cpu: list[LoadItem] = []
            files: list[LoadItem] = []
            for it in job.items:
                if it.tier == CPU and it.slot not in bad:
                    cpu.append(it)
                elif it.tier in self.stores:
                    files.append(it)
                else:
                    failed.add(it.block_id)
            if cpu:
                t0 = time.perf_counter()
                nbytes = 0
                for group, items in _by_group(cpu).items():
                    copier = self._copier(group)
                    copier.scatter(
                        [it.block_id for it in items],
                        copier.pool,
                        [it.slot for it in items],
                        after,
                    )
                    nbytes += len(items) * copier.block_bytes
                self.stats.add("load_bytes", nbytes, CPU)
                self.stats.add("load_seconds", time.perf_counter() - t0, CPU)
            if files:
                failed |= self._load_files(job.req_id, files, after)
            if failed and len(self.copiers) > 1:
                # A prefix is all its groups' blocks or nothing: a state page without its
                # attention blocks (or the reverse) must never be used.
                failed = {it.block_id for it in job.items}
        except Exception:
            logger.exception("tiered KV cache: load of request %s failed", job.req_id)
            failed = {it.block_id for it in job.items}
        if failed:
            self.stats.add("failed_blocks", len(failed))
        return failed

    @contextlib.contextmanager
    def _fetch_remote(
        self, items: list[LoadItem]
    ) -> Iterator[Mapping[str, bytes | memoryview] | None]:
        """The remote tier's objects among ``items``, got in one call to the store (one
        round to the master for all of them, instead of one per block), valid inside the
        ``with`` (they may be views into the store's staging buffer); None when none."""
        sizes = {it.key: self._copier(it.group).block_bytes for it in items if it.tier == REMOTE}
        if not sizes or self.remote is None:
            yield None
            return
        with self.remote.fetching(sizes, self.tp_rank) as fetched:
            yield fetched

    def _read_in_place(
        self, items: list[LoadItem], fetched: Mapping[str, bytes | memoryview] | None = None
    ) -> list[tuple[LoadItem, str | None]]:
        """I/O pool: read each block file straight into its block's pieces in the (CPU)
        cache, verify it, and promote the block into its CPU row; (item, None on success
        or why it failed) per item."""
        out = []
        for it in items:
            copier = self._copier(it.group)
            err = self._read(it.tier, it.key, copier.pieces(it.block_id), fetched)
            if err is None and it.promote_slot >= 0:
                copier.gather([it.block_id], copier.pool, [it.promote_slot])
            out.append((it, err))
        return out

    def _load_files(self, req_id: str, items: list[LoadItem], after: Any = None) -> set[int]:
        """Read, verify and place block files; returns failed block ids.

        CPU caches: the blocks are split among the I/O pool's threads, each reading its share
        in place (``preadv`` into the block's pieces, checksum, promotion), so reads,
        checksums and copies of different blocks overlap. Other caches: ``STAGE_BYTES`` of
        blocks at a time into a per-thread pinned row buffer (reused), then one staged copy
        to the device.
        """
        t0 = time.perf_counter()
        failed: set[int] = set()
        loaded: dict[str, int] = {}
        loaded_bytes: dict[str, int] = {}
        promoted: set[int] = set()
        with self._fetch_remote(items) as fetched:
            if self._blocks.in_place:  # one task per I/O thread, a contiguous share each
                k = min(self.cfg.io_threads, len(items))
                shares = [items[i * len(items) // k : (i + 1) * len(items) // k] for i in range(k)]
                futures = [self._io.submit(self._read_in_place, s, fetched) for s in shares]
                results = [r for f in futures for r in f.result()]
            else:
                results = []
                for group, group_items in _by_group(items).items():
                    results += self._read_staged(group, group_items, fetched, after)
        bad_rows: set[int] = set()
        for it, err in results:
            if err is None:
                loaded[it.tier] = loaded.get(it.tier, 0) + 1
                loaded_bytes[it.tier] = (
                    loaded_bytes.get(it.tier, 0) + self._copier(it.group).block_bytes
                )
                if it.promote_slot >= 0:
                    promoted.add(it.promote_slot)
                continue
            failed.add(it.block_id)
            if it.promote_slot >= 0:
                bad_rows.add(it.promote_slot)
            logger.warning(
                "tiered KV cache: request %s block %s (%s tier) not loaded: %s",
                req_id,
                it.key,
                it.tier,
                err,
            )
        with self._lock:  # a row whose promotion failed is never loaded
            self._bad_slots = (self._bad_slots - promoted) | bad_rows
        seconds = time.perf_counter() - t0
        total = sum(loaded.values())
        for tier, n in loaded.items():
            self.stats.add("load_bytes", loaded_bytes[tier], tier)
            self.stats.add("load_seconds", seconds * n / total, tier)
        return failed

    def _read_staged(
        self,
        group: int,
        items: list[LoadItem],
        fetched: Mapping[str, bytes | memoryview] | None,
        after: Any = None,
    ) -> list[tuple[LoadItem, str | None]]:
        """Read one group's block files ``STAGE_BYTES`` at a time into a per-thread pinned
        row buffer (reused), then copy each round to the device in one staged copy."""
        copier = self._copier(group)
        nbytes = copier.block_bytes
        results: list[tuple[LoadItem, str | None]] = []
        per = max(1, STAGE_BYTES // nbytes)
        bufs = getattr(self._tls, "files", None)
        if bufs is None:
            bufs = self._tls.files = {}
        buf = bufs.get(group)
        if buf is None or buf.shape != (per, nbytes):
            buf = bufs[group] = copier.empty_rows(per)
        for at in range(0, len(items), per):
            chunk = items[at : at + per]
            reads = [
                self._io.submit(self._read, it.tier, it.key, buf[j].numpy(), fetched)
                for j, it in enumerate(chunk)
            ]
            errors = [f.result() for f in reads]
            ok = [j for j, err in enumerate(errors) if err is None]
            copier.scatter([chunk[j].block_id for j in ok], buf, ok, after)
            for j in ok:
                if chunk[j].promote_slot >= 0:
                    copier.pool[chunk[j].promote_slot, :nbytes].copy_(buf[j])
            results += list(zip(chunk, errors, strict=True))
        return results

    def get_finished(
        self, finished_req_ids: AbstractSet[str] = frozenset()
    ) -> tuple[set[str], set[str]]:
        """(finished requests whose saves no longer read their blocks, requests whose load
        ended, successfully or not) since the last call.

        ``finished_req_ids`` are the requests vLLM finished since the last step; those that
        had blocks saved (vLLM holds their blocks for us) are reported once their gathers
        are done.
        """
        sending: set[str] = set()
        with self._lock:
            self._finishing |= {rid for rid in finished_req_ids if rid in self._saves}
            for rid in list(self._finishing):
                if all(f.done() for f in self._saves[rid]):
                    self._finishing.discard(rid)
                    for f in self._saves.pop(rid):
                        if f.exception() is not None:
                            logger.error(
                                "tiered KV cache: save of request %s failed: %s",
                                rid,
                                f.exception(),
                            )
                    sending.add(rid)
            for rid, futs in list(self._saves.items()):  # keep lists of live requests short
                if rid not in self._finishing and len(futs) > 1:
                    futs[:] = [f for f in futs if not f.done()] or futs[-1:]
        done: set[str] = set()
        for rid, fut in list(self._loads.items()):
            if fut.done():
                del self._loads[rid]
                failed = fut.result()
                if failed and len(self.copiers) > 1:
                    self._failed_loads.add(rid)  # vLLM maps no block id to a group
                else:
                    self._load_errors |= failed
                done.add(rid)
        return sending, done

    def take_failed_loads(self) -> set[str]:
        """Requests of a model with several KV cache groups whose load failed since the last
        call (reported in ``failed_recving``: vLLM recomputes them from the start)."""
        failed, self._failed_loads = self._failed_loads, set()
        return failed

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Block until queued loads and file writes are done (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        for fut in list(self._loads.values()):
            fut.result(timeout=max(0.0, deadline - time.monotonic()))
        self._saver.submit(lambda: None).result(timeout=max(0.0, deadline - time.monotonic()))
        self._io.submit(lambda: None).result(timeout=max(0.0, deadline - time.monotonic()))
        while self._pending_writes:
            if time.monotonic() > deadline:
                break
            time.sleep(0.005)

    def shutdown(self) -> None:
        self._loader.shutdown(wait=True, cancel_futures=True)
        self._saver.shutdown(wait=True)
        self._io.shutdown(wait=True)
        if self.remote is not None:
            self.remote.close()


def _by_group(items: Sequence[Any]) -> dict[int, list[Any]]:
    """``items`` (load or save items) by KV cache group, in order."""
    out: dict[int, list[Any]] = {}
    for it in items:
        out.setdefault(it.group, []).append(it)
    return out


def _file_tiers(s: SaveItem) -> tuple[tuple[str, bool], ...]:
    """The tiers past the CPU pool, and whether ``s`` goes to each."""
    return ((SSD, s.ssd), (SHARED, s.shared), (REMOTE, s.remote))
