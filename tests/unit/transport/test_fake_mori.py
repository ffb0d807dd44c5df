"""The fake MoRI-IO engine enforces the API contract the mori backend relies on.

Two fake engines in this process talk over the fake's TCP data plane on 127.0.0.1.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from tests.unit.transport import fake_mori as m


def _engine(key: str) -> m.IOEngine:
    e = m.IOEngine(key, m.IOEngineConfig("127.0.0.1", 0))
    e.create_backend(m.BackendType.RDMA, m.RdmaBackendConfig(qp_per_transfer=1))
    return e


@pytest.fixture
def pair() -> Iterator[tuple[m.IOEngine, m.IOEngine]]:
    a, b = _engine("a"), _engine("b")
    a.register_remote_engine(b.get_engine_desc())
    b.register_remote_engine(a.get_engine_desc())
    yield a, b
    a.close()
    b.close()


def _mem(engine: m.IOEngine, buf: np.ndarray) -> m.MemoryDesc:
    return engine.register_memory(buf.ctypes.data, buf.nbytes, -1, m.MemoryLocationType.CPU)


def test_descriptors_pack_and_unpack() -> None:
    e = _engine("x")
    try:
        buf = np.zeros(64, np.uint8)
        md = _mem(e, buf)
        assert m.MemoryDesc.unpack(md.pack()) == md
        assert m.EngineDesc.unpack(e.get_engine_desc().pack()) == e.get_engine_desc()
        assert (md.engine_key, md.size, md.loc) == ("x", 64, m.MemoryLocationType.CPU)
    finally:
        e.close()


def test_backend_required_before_memory_and_sessions() -> None:
    e = m.IOEngine("nobackend", m.IOEngineConfig("127.0.0.1", 0))
    try:
        buf = np.zeros(64, np.uint8)
        with pytest.raises(RuntimeError, match="backend"):
            _mem(e, buf)
        with pytest.raises(RuntimeError):
            e.create_backend(m.BackendType.RDMA, m.XgmiBackendConfig())
    finally:
        e.close()


def test_sessions_need_registered_memory_and_remote_engine(pair) -> None:
    a, b = pair
    la, lb = np.zeros(64, np.uint8), np.zeros(64, np.uint8)
    ma, mb = _mem(a, la), _mem(b, lb)
    assert a.create_session(ma, mb) is not None
    assert a.create_session(mb, ma) is None  # local desc from another engine
    stranger = _engine("c")
    try:
        mc = _mem(stranger, np.zeros(64, np.uint8))
        assert a.create_session(ma, mc) is None  # remote engine not registered
    finally:
        stranger.close()
    with pytest.raises(NotImplementedError):
        a.batch_write(ma, [0], mb, [0], [8], a.allocate_transfer_uid())


def test_out_of_range_fails_at_once_and_moves_nothing(pair) -> None:
    a, b = pair
    la, lb = np.ones(64, np.uint8), np.zeros(64, np.uint8)
    sess = a.create_session(_mem(a, la), _mem(b, lb))
    st = sess.batch_write([0, 32], [0, 32], [32, 34], sess.allocate_transfer_uid())
    assert st.Failed() and st.Code() is m.StatusCode.ERR_INVALID_ARGS
    assert lb.sum() == 0


def test_status_is_polled_to_success_and_bytes_move(pair) -> None:
    a, b = pair
    la = np.arange(64, dtype=np.uint8)
    lb = np.zeros(64, np.uint8)
    sess = a.create_session(_mem(a, la), _mem(b, lb))
    uid = sess.allocate_transfer_uid()
    st = sess.batch_write([0, 32], [32, 0], [32, 32], uid)
    assert st.Wait(10) and st.Succeeded() and not st.InProgress()
    assert np.array_equal(lb, np.concatenate([la[32:], la[:32]]))
    inbound = b.pop_inbound_transfer_status("a", uid)
    assert inbound is not None and inbound.Succeeded()
    assert b.pop_inbound_transfer_status("a", uid) is None  # popped once
    st = sess.batch_read([0], [0], [16], sess.allocate_transfer_uid())
    assert st.Wait(10) and st.Succeeded()
    assert np.array_equal(la[:16], lb[:16])


def test_uid_reuse_and_deregistered_memory_fail(pair) -> None:
    a, b = pair
    la, lb = np.zeros(64, np.uint8), np.zeros(64, np.uint8)
    ma = _mem(a, la)
    sess = a.create_session(ma, _mem(b, lb))
    uid = sess.allocate_transfer_uid()
    assert sess.batch_write([0], [0], [8], uid).Wait(10)
    st = sess.batch_write([0], [0], [8], uid)
    assert st.Failed() and "reused" in st.Message()
    a.deregister_memory(ma)
    st = sess.batch_write([0], [0], [8], sess.allocate_transfer_uid())
    assert st.Failed() and st.Code() is m.StatusCode.ERR_BAD_STATE
    assert not sess.alive()


def test_target_side_checks_remote_memory_too(pair) -> None:
    a, b = pair
    la, lb = np.zeros(64, np.uint8), np.zeros(64, np.uint8)
    mb = _mem(b, lb)
    sess = a.create_session(_mem(a, la), mb)
    b.deregister_memory(mb)  # the initiator cannot know
    st = sess.batch_write([0], [0], [8], sess.allocate_transfer_uid())
    assert st.Wait(10) and st.Failed() and st.Code() is m.StatusCode.ERR_NOT_FOUND


def test_sq_full_knob(pair) -> None:
    a, b = pair
    sess = a.create_session(_mem(a, np.zeros(8, np.uint8)), _mem(b, np.zeros(8, np.uint8)))
    a.sq_full_budget = 1
    st = sess.batch_write([0], [0], [8], sess.allocate_transfer_uid())
    assert st.Failed() and "SQ full" in st.Message()
    assert sess.batch_write([0], [0], [8], sess.allocate_transfer_uid()).Wait(10)
