"""The mori backend's own behaviour over the fake engine, in one process."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from tests.skips import missing, not_applicable
from tests.unit.transport import fake_mori
from vllm_pd_ext.transport import (
    PeerMismatch,
    TransferError,
    TransferState,
    TransferTimeout,
    TransportClosed,
    TransportDescriptor,
    TransportError,
    get_backend,
)
from vllm_pd_ext.transport.mori import MoriTransport


def _mori(**settings) -> MoriTransport:
    t = get_backend("mori", module=fake_mori, **settings)
    assert isinstance(t, MoriTransport)
    return t


@pytest.fixture
def pair() -> Iterator[tuple[MoriTransport, MoriTransport, np.ndarray, np.ndarray]]:
    a, b = _mori(max_batch_entries=100), _mori()
    src = np.arange(1 << 16, dtype=np.uint32).view(np.uint8)
    dst = np.zeros_like(src)
    a.register_buffer("kv", src.ctypes.data, src.nbytes, owner=src)
    b.register_buffer("kv", dst.ctypes.data, dst.nbytes, owner=dst)
    a.connect(b.descriptor())
    b.connect(a.descriptor())
    yield a, b, src, dst
    a.close()
    b.close()


def test_chunks_posts_to_max_batch_entries(pair) -> None:
    a, b, src, dst = pair
    spans = [(i * 64, i * 64, 32) for i in range(250)]  # not adjacent: no coalescing
    a.write(b.engine_id, "kv", "kv", spans).wait(30)
    assert a._engine.posts == [100, 100, 50]
    for i in range(250):
        assert np.array_equal(dst[i * 64 : i * 64 + 32], src[i * 64 : i * 64 + 32])


def test_sq_full_posts_are_retried(pair) -> None:
    a, b, src, dst = pair
    a._engine.sq_full_budget = 2
    a.write(b.engine_id, "kv", "kv", [(0, 0, 1024)]).wait(30)
    assert len(a._engine.posts) == 3
    assert np.array_equal(dst[:1024], src[:1024])


def test_sq_full_past_the_retry_window_fails_the_transfer() -> None:
    a, b = _mori(sq_full_retry_s=0.0), _mori()
    try:
        buf = np.zeros(64, np.uint8)
        a.register_buffer("kv", buf.ctypes.data, 64, owner=buf)
        b.register_buffer("kv", buf.ctypes.data, 64, owner=buf)
        a.connect(b.descriptor())
        a._engine.sq_full_budget = 1
        h = a.write(b.engine_id, "kv", "kv", [(0, 0, 8)])
        with pytest.raises(TransferError, match="SQ full"):
            h.wait(5)
        assert a.stats.totals().failures == 1
    finally:
        a.close()
        b.close()


def test_a_transfer_with_a_failed_chunk_fails_only_once_every_chunk_ended() -> None:
    """A write posted in two chunks, the first refused ("SQ full" past the retry window)
    while the second is still in flight: the handle stays pending until the second ended,
    and its bytes have landed when the failure is reported. A handle that is no longer
    pending lands nothing more (what a WRITE's prefill relies on before it tells the
    decode that it may reuse its blocks)."""
    a, b = _mori(max_batch_entries=1, sq_full_retry_s=0.0), _mori()
    try:
        src = np.arange(256, dtype=np.uint8)
        dst = np.zeros_like(src)
        a.register_buffer("kv", src.ctypes.data, src.nbytes, owner=src)
        b.register_buffer("kv", dst.ctypes.data, dst.nbytes, owner=dst)
        a.connect(b.descriptor())
        a._engine.sq_full_budget = 1  # the first chunk's post
        a._engine.gate.clear()  # the second chunk is accepted, and held
        h = a.write(b.engine_id, "kv", "kv", [(0, 0, 8), (64, 64, 8)])
        assert a._engine.posts == [1, 1]
        assert h.poll() is TransferState.PENDING
        a._engine.gate.set()
        with pytest.raises(TransferError, match="SQ full"):
            h.wait(30)
        assert np.array_equal(dst[64:72], src[64:72]) and not dst[:8].any()
    finally:
        a._engine.gate.set()
        a.close()
        b.close()


def test_sessions_are_cached_per_region_pair(pair) -> None:
    a, b, _, _ = pair
    for _ in range(3):
        a.write(b.engine_id, "kv", "kv", [(0, 0, 8)]).wait(30)
    assert len(a._sessions) == 1
    a.unregister("kv")
    assert a._sessions == {}


def test_descriptor_without_mori_fields_is_refused(pair) -> None:
    a, b, _, _ = pair
    d = b.descriptor().to_dict()
    d["extra"] = {k: v for k, v in d["extra"].items() if not k.startswith("mem:")}
    d["engine_id"] = "other"
    with pytest.raises(PeerMismatch):
        a.connect(TransportDescriptor.from_dict(d))


def test_rdma_backend_config_reaches_the_engine() -> None:
    t = _mori(qp_per_transfer=4, num_worker_threads=2)
    try:
        cfg = t._engine._backends[fake_mori.BackendType.RDMA]
        assert (cfg.qp_per_transfer, cfg.num_worker_threads, cfg.enable_notification) == (
            4,
            2,
            False,
        )
    finally:
        t.close()
    t = _mori(backend="tcp")
    try:
        assert fake_mori.BackendType.TCP in t._engine._backends
    finally:
        t.close()


def test_missing_mori_module_is_a_clear_error() -> None:
    if not missing("mori"):
        not_applicable("mori is installed: this checks the error when it is not")
    with pytest.raises(TransportError, match="amd-mori"):
        get_backend("mori")


def test_held_transfers_time_out_and_block_notify(pair) -> None:
    a, b, src, dst = pair
    a._engine.gate.clear()  # the engine accepts transfers but does not run them
    try:
        h1 = a.write(b.engine_id, "kv", "kv", [(0, 0, 64)])
        h2 = a.write(b.engine_id, "kv", "kv", [(64, 64, 64)])
        with pytest.raises(TransferTimeout):
            a.wait_all([h1, h2], 0.2)
        with pytest.raises(TransferTimeout):
            a.notify(b.engine_id, b"done", timeout=0.2)  # would overtake the pending writes
        assert b.drain_notifications() == []
        assert a.stats.totals().timeouts == 2 and a.stats.totals().notifications_sent == 0
    finally:
        a._engine.gate.set()
    a.wait_all([h1, h2], 30)
    a.notify(b.engine_id, b"done", timeout=30)
    assert np.array_equal(dst[:128], src[:128])
    notes = []
    for _ in range(100):  # bounded: the ack came back, so it is queued already
        notes = b.drain_notifications()
        if notes:
            break
    assert [(n.sender, n.payload) for n in notes] == [(a.engine_id, b"done")]


def test_pending_handles_are_abandoned_on_close(pair) -> None:
    a, b, _, _ = pair
    a._engine.gate.clear()
    h = a.write(b.engine_id, "kv", "kv", [(0, 0, 64)])
    a.close()
    with pytest.raises(TransportClosed):
        h.poll()
    with pytest.raises(TransportClosed):
        h.wait(1)
