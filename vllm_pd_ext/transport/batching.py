"""A per-peer worker thread that merges queued transfers into few synchronous engine calls.

For engines whose batched calls block until done (Mooncake's ``batch_transfer_sync_*``) and
must not overlap for one peer. Transfers queued while a call runs are merged: consecutive
transfers of the same direction are concatenated and posted in calls of at most
``max_entries`` entries, so 28 per-layer writes of a small prompt cost one engine call, not
28. Any other callable (a notification) is a barrier: it runs after everything queued
before it, alone. Every item completes in submission order.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import cast

from vllm_pd_ext.transport.base import TransferOp, TransferState
from vllm_pd_ext.transport.errors import TransferError, TransportClosed

logger = logging.getLogger(__name__)

#: ``call(op, local_addrs, remote_addrs, lengths) -> return code`` (0 = success).
EngineCall = Callable[[TransferOp, list[int], list[int], list[int]], int]


@dataclass
class QueuedTransfer:
    """One transfer waiting for (or done by) the worker; also the transport's BackendJob."""

    op: TransferOp
    local_addrs: list[int]
    remote_addrs: list[int]
    lengths: list[int]
    future: Future = field(default_factory=Future)
    finished_at: float | None = None

    def state(self) -> tuple[TransferState, str | None]:
        if not self.future.done():
            return TransferState.PENDING, None
        exc = self.future.exception()
        return (TransferState.FAILED, str(exc)) if exc else (TransferState.DONE, None)

    def wait(self, timeout: float) -> bool:
        try:
            self.future.exception(timeout=max(0.0, timeout))
        except FutureTimeout:
            return False
        return True


@dataclass
class _Barrier:
    fn: Callable[[], object]
    future: Future = field(default_factory=Future)


class PeerWorker:
    """Runs one peer's transfers and barriers in order on its own daemon thread."""

    def __init__(self, name: str, call: EngineCall, max_entries: int) -> None:
        self._call = call
        self._max = max_entries
        self._queue: queue.SimpleQueue[QueuedTransfer | _Barrier | None] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, item: QueuedTransfer) -> QueuedTransfer:
        """Queue a transfer; its future completes when its entries were posted."""
        self._put(item)
        return item

    def run_after_queued(self, fn: Callable[[], object]) -> Future:
        """Queue ``fn`` to run after everything queued so far; returns its future."""
        barrier = _Barrier(fn)
        self._put(barrier)
        return barrier.future

    def _put(self, item: QueuedTransfer | _Barrier) -> None:
        if self._closed:
            raise TransportClosed("the peer worker was shut down")
        self._queue.put(item)

    def shutdown(self) -> None:
        """Stop after the engine call in progress; fail whatever is still queued."""
        self._closed = True
        self._queue.put(None)

    # ------------------------------------------------------------------ worker
    def _run(self) -> None:
        while True:
            items = [self._queue.get()]
            while True:  # take everything queued right now, in order
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = None in items
            if stop:
                items = items[: items.index(None)]
            if self._closed:
                self._fail_all(items)
                self._drain_after_stop()
                return
            self._process(cast("list[QueuedTransfer | _Barrier]", items))  # no None left

    def _process(self, items: list[QueuedTransfer | _Barrier]) -> None:
        group: list[QueuedTransfer] = []
        for item in items:
            if isinstance(item, QueuedTransfer) and (not group or group[0].op is item.op):
                group.append(item)
                continue
            self._post_group(group)
            group = []
            if isinstance(item, QueuedTransfer):
                group = [item]
            else:
                self._run_barrier(item)
        self._post_group(group)

    def _post_group(self, group: list[QueuedTransfer]) -> None:
        if not group:
            return
        op = group[0].op
        local = [a for t in group for a in t.local_addrs]
        remote = [a for t in group for a in t.remote_addrs]
        lengths = [n for t in group for n in t.lengths]
        ends, pos = [], 0
        for t in group:
            pos += len(t.lengths)
            ends.append(pos)
        errors: list[tuple[int, int, str]] = []  # (first entry, last entry + 1, message)
        done = 0  # transfers of the group already completed
        for start in range(0, len(lengths), self._max):
            stop = min(start + self._max, len(lengths))
            try:
                rc = self._call(op, local[start:stop], remote[start:stop], lengths[start:stop])
            except Exception as e:  # the engine raising must not kill the worker
                rc, msg = -1, f"{type(e).__name__}: {e}"
            else:
                msg = f"returned {rc}"
            if rc != 0:
                errors.append((start, stop, msg))
            while done < len(group) and ends[done] <= stop:
                self._complete(
                    group[done], ends[done] - len(group[done].lengths), ends[done], errors
                )
                done += 1

    def _complete(
        self, t: QueuedTransfer, first: int, end: int, errors: list[tuple[int, int, str]]
    ) -> None:
        t.finished_at = time.perf_counter()
        bad = [msg for lo, hi, msg in errors if lo < end and first < hi]
        if bad:
            t.future.set_exception(
                TransferError(f"engine batch_transfer_sync_{t.op.value} {bad[0]}")
            )
        else:
            t.future.set_result(None)

    def _run_barrier(self, barrier: _Barrier) -> None:
        try:
            barrier.fn()
        except Exception as e:
            barrier.future.set_exception(e)
        else:
            barrier.future.set_result(None)

    def _fail_all(self, items: list[QueuedTransfer | _Barrier | None]) -> None:
        for item in items:
            if item is not None and not item.future.done():
                item.future.set_exception(TransportClosed("transport closed before this ran"))

    def _drain_after_stop(self) -> None:
        while True:
            try:
                self._fail_all([self._queue.get_nowait()])
            except queue.Empty:
                return
