"""The per-peer worker merges queued transfers, keeps order, and maps failures to transfers."""

from __future__ import annotations

import threading

import pytest

from vllm_pd_ext.transport.base import TransferOp, TransferState
from vllm_pd_ext.transport.batching import PeerWorker, QueuedTransfer
from vllm_pd_ext.transport.errors import TransferError, TransportClosed

W, R = TransferOp.WRITE, TransferOp.READ


class Engine:
    """Records calls; the first call blocks until ``release`` so that others queue up."""

    def __init__(self, fail_calls: tuple[int, ...] = ()) -> None:
        self.calls: list[tuple[TransferOp, list[int]]] = []
        self.started = threading.Event()
        self.release = threading.Event()
        self.fail_calls = fail_calls

    def __call__(self, op, local, remote, lengths) -> int:
        self.calls.append((op, list(local)))
        self.started.set()
        assert self.release.wait(10)
        return -1 if len(self.calls) - 1 in self.fail_calls else 0


def job(op: TransferOp, *addrs: int) -> QueuedTransfer:
    return QueuedTransfer(op, list(addrs), list(addrs), [1] * len(addrs))


def test_transfers_queued_behind_a_call_are_merged_in_order() -> None:
    eng = Engine()
    w = PeerWorker("t", eng, max_entries=4)
    try:
        first = w.submit(job(W, 0))
        assert eng.started.wait(10)  # the worker is inside the first call now
        a, b, c = w.submit(job(W, 1, 2)), w.submit(job(W, 3)), w.submit(job(R, 4))
        d = w.submit(job(R, 5, 6, 7, 8, 9))
        eng.release.set()
        for t in (first, a, b, c, d):
            assert t.wait(10) and t.state() == (TransferState.DONE, None)
        assert eng.calls == [(W, [0]), (W, [1, 2, 3]), (R, [4, 5, 6, 7]), (R, [8, 9])]
    finally:
        w.shutdown()


def test_a_barrier_runs_after_everything_queued_before_it() -> None:
    eng = Engine()
    eng.release.set()
    w = PeerWorker("t", eng, max_entries=8)
    seen: list[int] = []
    try:
        t = w.submit(job(W, 0, 1))
        fut = w.run_after_queued(lambda: seen.append(len(eng.calls)))
        fut.result(10)
        assert t.state()[0] is TransferState.DONE and seen == [1]
        boom = w.run_after_queued(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            boom.result(10)
        assert w.submit(job(W, 2)).wait(10)  # the worker survived
    finally:
        w.shutdown()


def test_a_failed_call_fails_exactly_the_transfers_it_carried() -> None:
    eng = Engine(fail_calls=(1,))
    w = PeerWorker("t", eng, max_entries=2)
    try:
        first = w.submit(job(W, 0))
        assert eng.started.wait(10)
        a, b, c = w.submit(job(W, 1)), w.submit(job(W, 2, 3)), w.submit(job(W, 4))
        eng.release.set()
        for t in (first, a, b, c):
            assert t.wait(10)
        # calls: [0] ok, [1, 2] fails, [3, 4] ok -> a and b (which owns 2 and 3) fail
        assert [t.state()[0] for t in (first, a, b, c)] == [
            TransferState.DONE,
            TransferState.FAILED,
            TransferState.FAILED,
            TransferState.DONE,
        ]
        with pytest.raises(TransferError):
            b.future.result()
    finally:
        w.shutdown()


def test_shutdown_fails_what_is_still_queued() -> None:
    eng = Engine()
    w = PeerWorker("t", eng, max_entries=4)
    first = w.submit(job(W, 0))
    assert eng.started.wait(10)
    queued = w.submit(job(W, 1))
    w.shutdown()
    eng.release.set()
    assert first.wait(10) and queued.wait(10)
    assert queued.state()[0] is TransferState.FAILED
    with pytest.raises(TransportClosed):
        w.submit(job(W, 2))
