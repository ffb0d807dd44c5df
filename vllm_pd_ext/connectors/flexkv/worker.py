"""Worker side of the tiered KV cache (runs in each vLLM worker process).

Holds the CPU tier (one ``[slots, block_bytes]`` byte tensor, pinned when a GPU is present)
and moves blocks between vLLM's KV cache tensors, that pool and block files:

* saves leave the engine step at once: ``wait_for_save`` hands the step's completed blocks
  to one save thread, which gathers them (one ``index_select`` per view into a staging
  tensor), copies them into their CPU pool rows and queues their file writes (checksums,
  writes) to a bounded I/O pool (when the queue is full a write is dropped and counted,
  never awaited). The blocks are read after the step, so they must stay put until the
  gather ends: a finished request's blocks are held by vLLM until ``get_finished`` reports
  it in ``finished_sending`` (the scheduler side returned True from ``request_finished``),
  and ``handle_preemptions`` waits for the gathers of requests preempted in this step
  before the forward pass may overwrite their blocks;
* loads run on a small thread pool: CPU rows and verified block files are scattered into the
  request's blocks, file blocks are promoted into the CPU rows the scheduler reserved, and
  the request is reported in ``finished_recving``; blocks that could not be read (missing,
  corrupt, other layout) are reported through ``get_block_ids_with_load_errors()`` in the
  same pass, so vLLM's ``kv_load_failure_policy`` recomputes or fails them. A load first
  waits for pending saves of the CPU rows it reads or promotes into.

Block bytes are addressed through :func:`~vllm_pd_ext.connectors.flexkv.blocks.block_views`
(the shared KV layout of ``connectors/common/layout.py``), so any attention backend whose
blocks are a fixed set of byte pieces works.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

import torch

from vllm_pd_ext.connectors.flexkv.blocks import BlockView, block_views
from vllm_pd_ext.connectors.flexkv.config import FlexKVConfig
from vllm_pd_ext.connectors.flexkv.metadata import (
    CPU,
    SHARED,
    SSD,
    FlexKVMetadata,
    LoadItem,
    LoadJob,
    SaveItem,
)
from vllm_pd_ext.connectors.flexkv.stats import FlexKVRecorder
from vllm_pd_ext.connectors.flexkv.store import BlockFileError, FileStore

logger = logging.getLogger(__name__)

#: Bytes of the per-thread staging buffer block copies go through (reused, so stays warm).
STAGE_BYTES = 8 << 20
#: Bytes of block files read per round into a per-loader-thread buffer (reused).
FILE_STAGE_BYTES = 32 << 20


def _runs(picks: list[int]) -> list[tuple[int, int]]:
    """``[a, b)`` ranges of ``picks`` whose values are consecutive integers."""
    runs: list[tuple[int, int]] = []
    a = 0
    for j in range(1, len(picks) + 1):
        if j == len(picks) or picks[j] != picks[j - 1] + 1:
            runs.append((a, j))
            a = j
    return runs


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
    ) -> None:
        self.cfg = cfg
        self.namespace = namespace
        self.num_blocks, self.block_size = num_blocks, block_size
        self.model = dict(model)
        self.cpu_slots = cpu_slots
        self.tp_rank = tp_rank
        self.stats = FlexKVRecorder()
        self.fingerprint = ""
        self.block_bytes = 0
        self.pool: torch.Tensor | None = None
        self._views: list[BlockView] = []
        self._device = torch.device("cpu")
        self.stores: dict[str, FileStore] = {}
        if cfg.ssd_dir:
            self.stores[SSD] = FileStore(cfg.ssd_dir, namespace, fsync=cfg.fsync)
        if cfg.shared_dir:
            self.stores[SHARED] = FileStore(cfg.shared_dir, namespace, fsync=cfg.fsync)
        self._io = ThreadPoolExecutor(cfg.io_threads, thread_name_prefix="flexkv-io")
        self._loader = ThreadPoolExecutor(cfg.load_threads, thread_name_prefix="flexkv-load")
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="flexkv-save")
        self._saves: dict[str, list[Future]] = {}  # req id -> its gathers not yet reported
        self._finishing: set[str] = set()  # finished requests whose blocks vLLM holds for us
        self._slot_writer: dict[int, Future] = {}  # CPU pool row -> the save writing it
        self._bad_slots: set[int] = set()  # CPU rows whose save failed: never loaded
        self._pending_writes = 0
        self._meta: FlexKVMetadata | None = None
        self._loads: dict[str, Future] = {}
        self._load_errors: set[int] = set()
        self._lock = threading.Lock()
        self._tls = threading.local()

    # ---- setup ----
    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Map every block's bytes and allocate the CPU tier."""
        views = block_views(
            kv_caches, num_blocks=self.num_blocks, block_size=self.block_size, model=self.model
        )
        self._views = list(views.views)
        self.fingerprint = views.fingerprint
        self._device = self._views[0].view.device
        self.block_bytes = views.block_bytes
        pin = torch.cuda.is_available()
        self.pool = torch.empty(
            (self.cpu_slots, self.block_bytes), dtype=torch.uint8, pin_memory=pin
        )
        logger.info(
            "tiered KV cache worker: %d KiB per block, CPU tier %d blocks (%.1f MiB), layout %s",
            self.block_bytes // 1024,
            self.cpu_slots,
            self.cpu_slots * self.block_bytes / (1 << 20),
            self.fingerprint,
        )

    def gather(self, block_ids: list[int]) -> torch.Tensor:
        """Copy device blocks into a new CPU tensor ``[len(block_ids), block_bytes]``."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self._device)
        out = torch.empty((len(block_ids), self.block_bytes), dtype=torch.uint8)
        for v in self._views:
            out[:, v.column : v.column + v.length].view(v.view.dtype).copy_(
                v.view.index_select(0, idx)
            )
        return out

    def scatter(self, block_ids: list[int], rows: torch.Tensor, picks: list[int]) -> None:
        """Copy row ``picks[j]`` of ``rows`` (CPU, ``[m, block_bytes]``) into device block
        ``block_ids[j]`` for every ``j``.

        No large temporaries: fresh memory's first-touch page faults cost more than the copy
        itself (~1 GB/s vs ~16 GB/s for a warm memcpy on a 2-core host). On CPU, each run of
        consecutive ``picks`` is one ``index_copy_`` straight from a slice of ``rows`` (a
        single copy); scattered picks and device caches go view by view in chunks through a
        small per-thread staging buffer that is reused.
        """
        runs = _runs(picks)
        if self._device.type == "cpu" and len(runs) * 4 <= max(len(picks), 4):
            for v in self._views:
                cols = rows[:, v.column : v.column + v.length].view(v.view.dtype)
                for a, b in runs:
                    dst = torch.tensor(block_ids[a:b], dtype=torch.long)
                    v.view.index_copy_(0, dst, cols[picks[a] : picks[a] + b - a])
            return
        dst = torch.tensor(block_ids, dtype=torch.long, device=self._device)
        src = torch.tensor(picks, dtype=torch.long)
        stage = getattr(self._tls, "stage", None)
        if stage is None:
            stage = self._tls.stage = torch.empty(STAGE_BYTES, dtype=torch.uint8)
        for v in self._views:
            cols = rows[:, v.column : v.column + v.length].view(v.view.dtype)
            step = max(1, STAGE_BYTES // v.length)
            if step * v.length > stage.numel():
                stage = self._tls.stage = torch.empty(step * v.length, dtype=torch.uint8)
            for a in range(0, len(block_ids), step):
                n = len(picks[a : a + step])
                tmp = stage[: n * v.length].view(v.view.dtype).view(n, -1)
                torch.index_select(cols, 0, src[a : a + step], out=tmp)
                v.view.index_copy_(0, dst[a : a + step], tmp.to(self._device))

    # ---- per step ----
    def bind(self, meta: FlexKVMetadata) -> None:
        self._meta = meta

    def start_load_kv(self) -> None:
        """Start this step's loads (asynchronous; reported by :meth:`get_finished`)."""
        meta = self._meta
        if meta is None:
            return
        for job in meta.loads:
            slots = {it.slot for it in job.items} | {it.promote_slot for it in job.items}
            with self._lock:
                after = [self._slot_writer[s] for s in slots if s in self._slot_writer]
            self._loads[job.req_id] = self._loader.submit(self._run_load, job, after)

    def wait_for_save(self) -> None:
        """Hand the step's completed blocks to the save thread; returns without copying."""
        meta, self._meta = self._meta, None
        if meta is None:
            return
        if meta.clear_ssd and SSD in self.stores:
            self._io.submit(self.stores[SSD].clear)
        if SSD in self.stores:
            for key in meta.ssd_deletes:
                self._io.submit(self.stores[SSD].delete, key)
        if not meta.saves:
            return
        saves = list(meta.saves)
        fut = self._saver.submit(self._run_save, saves)
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

    def _run_save(self, saves: list[SaveItem]) -> None:
        """Save thread: gather the blocks, fill their CPU rows, queue their file writes."""
        t0 = time.perf_counter()
        to_cpu = [(j, s) for j, s in enumerate(saves) if s.slot >= 0]
        try:
            rows = self.gather([s.block_id for s in saves])
            if to_cpu:
                sel = torch.tensor([j for j, _ in to_cpu], dtype=torch.long)
                slots = torch.tensor([s.slot for _, s in to_cpu], dtype=torch.long)
                self.pool.index_copy_(0, slots, rows.index_select(0, sel))
        except Exception:
            # The scheduler already lists these rows as ready: make their loads fail instead.
            logger.exception("tiered KV cache: saving %d blocks failed", len(saves))
            with self._lock:
                self._bad_slots |= {s.slot for _, s in to_cpu}
            return
        if to_cpu:
            with self._lock:
                self._bad_slots -= {s.slot for _, s in to_cpu}
            self.stats.add("save_bytes", len(to_cpu) * self.block_bytes, CPU)
            self.stats.add("save_seconds", time.perf_counter() - t0, CPU)
        for j, s in enumerate(saves):
            for tier, wanted in ((SSD, s.ssd), (SHARED, s.shared)):
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

    def _read(self, tier: str, key: str, out: torch.Tensor) -> str | None:
        """Read one block file into ``out``; None on success, else why it failed."""
        try:
            self.stores[tier].read_into(key, out.numpy(), self.fingerprint, self.tp_rank)
            return None
        except BlockFileError as e:
            self.stats.add("corrupt_blocks")
            return str(e)
        except OSError as e:
            return f"{type(e).__name__}: {e}"

    def _run_load(self, job: LoadJob, after: list[Future] = ()) -> set[int]:
        """Load one request's blocks once the saves in ``after`` (of the CPU rows it reads or
        promotes into) are done; returns the device block ids that failed."""
        failed: set[int] = set()
        try:
            wait_futures(after)
            with self._lock:
                bad = set(self._bad_slots)
            cpu = [it for it in job.items if it.tier == CPU and it.slot not in bad]
            files = [it for it in job.items if it.tier in self.stores]
            failed |= {it.block_id for it in job.items if it not in cpu and it not in files}
            if cpu:
                t0 = time.perf_counter()
                self.scatter([it.block_id for it in cpu], self.pool, [it.slot for it in cpu])
                self.stats.add("load_bytes", len(cpu) * self.block_bytes, CPU)
                self.stats.add("load_seconds", time.perf_counter() - t0, CPU)
            if files:
                failed |= self._load_files(job.req_id, files)
        except Exception:
            logger.exception("tiered KV cache: load of request %s failed", job.req_id)
            failed = {it.block_id for it in job.items}
        if failed:
            self.stats.add("failed_blocks", len(failed))
        return failed

    def _load_files(self, req_id: str, items: list[LoadItem]) -> set[int]:
        """Read, verify and scatter block files, ``FILE_STAGE_BYTES`` at a time through a
        per-thread buffer that is reused (no fresh memory per load); returns failed block ids."""
        t0 = time.perf_counter()
        per = max(1, FILE_STAGE_BYTES // self.block_bytes)
        buf = getattr(self._tls, "files", None)
        if buf is None or buf.shape != (per, self.block_bytes):
            buf = self._tls.files = torch.empty((per, self.block_bytes), dtype=torch.uint8)
        failed: set[int] = set()
        loaded: dict[str, int] = {}
        for at in range(0, len(items), per):
            chunk = items[at : at + per]
            futures = [
                self._io.submit(self._read, it.tier, it.key, buf[j]) for j, it in enumerate(chunk)
            ]
            errors = [f.result() for f in futures]
            ok = [j for j, err in enumerate(errors) if err is None]
            for j, err in enumerate(errors):
                if err is not None:
                    failed.add(chunk[j].block_id)
                    logger.warning(
                        "tiered KV cache: request %s block %s (%s tier) not loaded: %s",
                        req_id,
                        chunk[j].key,
                        chunk[j].tier,
                        err,
                    )
            if not ok:
                continue
            self.scatter([chunk[j].block_id for j in ok], buf, ok)
            promote = [(j, chunk[j].promote_slot) for j in ok if chunk[j].promote_slot >= 0]
            for j, slot in promote:
                self.pool[slot].copy_(buf[j])
            if promote:
                with self._lock:
                    self._bad_slots -= {s for _, s in promote}
            for j in ok:
                loaded[chunk[j].tier] = loaded.get(chunk[j].tier, 0) + 1
        seconds = time.perf_counter() - t0
        total = sum(loaded.values())
        for tier, n in loaded.items():
            self.stats.add("load_bytes", n * self.block_bytes, tier)
            self.stats.add("load_seconds", seconds * n / total, tier)
        return failed

    def get_finished(self, finished_req_ids: set[str] = frozenset()) -> tuple[set[str], set[str]]:
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
                self._load_errors |= fut.result()
                done.add(rid)
        return sending, done

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
