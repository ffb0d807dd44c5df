"""The transport contract, run over every backend between two real processes.

mooncake: the real engine over TCP on 127.0.0.1. mori: the real backend code over the fake
engine (tests/unit/transport/fake_mori.py). Bytes are always compared, never assumed.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.skips import need, not_applicable
from tests.unit.transport.backends import make_transport
from tests.unit.transport.conftest import PEER_SEED, REGION, Local, Remote
from tests.unit.transport.peer import PeerProcess, pattern
from vllm_pd_ext.transport import (
    PeerMismatch,
    PeerUnreachable,
    RegionBoundsError,
    RegistrationError,
    TransferError,
    TransferState,
    TransferTimeout,
    TransportClosed,
    TransportDescriptor,
    UnknownPeer,
    UnknownRegion,
)

BLOCK = 4096
NBLOCKS = REGION // BLOCK
WAIT_S = 60.0


def block_spans(n: int, seed: int) -> np.ndarray:
    """``n`` block-sized spans between random, distinct local and remote blocks."""
    rng = np.random.default_rng(seed)
    lb = rng.permutation(NBLOCKS)[:n]
    rb = rng.permutation(NBLOCKS)[:n]
    return np.stack([lb * BLOCK, rb * BLOCK, np.full(n, BLOCK)], axis=1)


def expect_after(
    dst: np.ndarray, src: np.ndarray, spans: np.ndarray, *, dst_col: int
) -> np.ndarray:
    """What ``dst`` holds after copying ``spans`` from ``src``."""
    out = dst.copy()
    src_col = 1 - dst_col
    for row in spans:
        d, s, n = int(row[dst_col]), int(row[src_col]), int(row[2])
        out[d : d + n] = src[s : s + n]
    return out


def peer_bytes(remote: Remote) -> np.ndarray:
    return np.frombuffer(remote.proc.call("bytes", "kv", 0, REGION), dtype=np.uint8)


def test_write_many_spans_lands_exact_bytes(local: Local, remote: Remote) -> None:
    spans = block_spans(300, seed=10)
    before = peer_bytes(remote)
    handle = local.transport.write(local.peer, "kv", "kv", spans)
    handle.wait(WAIT_S)
    assert handle.state is TransferState.DONE
    expected = expect_after(before, local.buf, spans, dst_col=1)
    assert np.array_equal(peer_bytes(remote), expected)
    snap = local.transport.stats.take()
    assert (snap.transfers, snap.failures, snap.bytes, snap.spans) == (1, 0, 300 * BLOCK, 300)
    assert len(snap.durations) == 1 and snap.seconds > 0
    assert local.transport.stats.take().transfers == 0  # take() starts a new interval


def test_read_many_spans_lands_exact_bytes(local: Local, remote: Remote) -> None:
    spans = block_spans(257, seed=11)
    before = local.buf.copy()
    handle = local.transport.read(local.peer, "kv", "kv", spans)
    local.transport.wait(handle, WAIT_S)
    expected = expect_after(before, pattern(PEER_SEED, REGION), spans, dst_col=0)
    assert np.array_equal(local.buf, expected)
    assert local.transport.stats.totals().bytes == 257 * BLOCK


def test_more_spans_than_one_engine_call(local: Local, remote: Remote) -> None:
    # 5000 non-adjacent 256-byte spans: more than one engine call for every backend.
    n, size, stride = 5000, 256, 768
    starts = np.arange(n) * stride
    spans = np.stack([starts, starts[::-1].copy(), np.full(n, size)], axis=1)
    before = peer_bytes(remote)
    handle = local.transport.write(local.peer, "kv", "kv", spans)
    handle.wait(WAIT_S)
    assert handle.posted_spans == n
    assert np.array_equal(peer_bytes(remote), expect_after(before, local.buf, spans, dst_col=1))


def test_adjacent_spans_are_coalesced(local: Local, remote: Remote) -> None:
    offs = np.arange(NBLOCKS // 2) * BLOCK
    spans = [(int(o), int(o) + REGION // 2, BLOCK) for o in offs]
    handle = local.transport.write(local.peer, "kv", "kv", spans)
    handle.wait(WAIT_S)
    assert (handle.spans, handle.posted_spans) == (NBLOCKS // 2, 1)
    got = peer_bytes(remote)
    assert np.array_equal(got[REGION // 2 :], local.buf[: REGION // 2])
    assert np.array_equal(got[: REGION // 2], pattern(PEER_SEED, REGION)[: REGION // 2])


@pytest.mark.parametrize(
    "spans",
    [
        [(0, REGION - 100, 200)],  # past the remote end
        [(REGION - 100, 0, 200)],  # past the local end
        [(-1, 0, 10)],  # negative offset
        [(0, 0, 0)],  # empty span
        [(0, 0, 100), (4096, 50, 100)],  # overlapping destination
        [(0, 0, 10, 1)],  # not a triple
    ],
    ids=["remote-end", "local-end", "negative", "empty", "overlap", "shape"],
)
def test_bad_spans_refused_before_the_engine(local: Local, remote: Remote, spans) -> None:
    with pytest.raises(RegionBoundsError):
        local.transport.write(local.peer, "kv", "kv", spans)
    assert np.array_equal(peer_bytes(remote), pattern(PEER_SEED, REGION))
    totals = local.transport.stats.totals()
    assert (totals.transfers, totals.failures, totals.bytes) == (0, 0, 0)


def test_overlapping_sources_are_fine_for_reads_of_distinct_targets(local: Local) -> None:
    # Overlap only matters where bytes land: two reads of the same remote bytes are legal.
    h = local.transport.read(local.peer, "kv", "kv", [(0, 0, 100), (4096, 0, 100)])
    h.wait(WAIT_S)
    assert np.array_equal(local.buf[:100], local.buf[4096:4196])


def test_zero_spans_give_a_finished_handle(local: Local) -> None:
    handle = local.transport.write(local.peer, "kv", "kv", [])
    assert handle.poll() is TransferState.DONE and handle.nbytes == 0


def test_unknown_peer_and_regions(local: Local) -> None:
    t = local.transport
    with pytest.raises(UnknownPeer):
        t.write("127.0.0.1:1", "kv", "kv", [(0, 0, 8)])
    with pytest.raises(UnknownRegion):
        t.write(local.peer, "nope", "kv", [(0, 0, 8)])
    with pytest.raises(PeerMismatch):
        t.read(local.peer, "kv", "nope", [(0, 0, 8)])
    with pytest.raises(RegistrationError):
        t.register_buffer("kv", local.buf.ctypes.data, 16)
    t.disconnect(local.peer)
    with pytest.raises(UnknownPeer):
        t.write(local.peer, "kv", "kv", [(0, 0, 8)])


def test_descriptor_round_trip_and_mismatch(local: Local, remote: Remote) -> None:
    desc = TransportDescriptor.from_bytes(remote.descriptor)
    assert TransportDescriptor.from_bytes(desc.to_bytes()) == desc
    assert desc.region("kv").size == REGION
    other = TransportDescriptor.from_dict({**desc.to_dict(), "backend": "other"})
    with pytest.raises(PeerMismatch):
        local.transport.connect(other)
    with pytest.raises(PeerMismatch):
        local.transport.connect(b"not json")
    with pytest.raises(PeerMismatch):
        local.transport.connect(local.transport.descriptor())  # itself


def test_closed_transport_refuses_every_call(local: Local) -> None:
    t = local.transport
    pending = t.write(local.peer, "kv", "kv", [(0, 0, 64)])
    pending.wait(WAIT_S)
    t.close()
    t.close()  # idempotent
    assert t.closed
    for call in (
        lambda: t.write(local.peer, "kv", "kv", [(0, 0, 8)]),
        lambda: t.register_buffer("x", local.buf.ctypes.data, 8),
        lambda: t.descriptor(),
        lambda: t.notify(local.peer, b"x"),
        lambda: t.drain_notifications(),
    ):
        with pytest.raises(TransportClosed):
            call()


def test_notify_arrives_after_the_writes_before_it(local: Local, remote: Remote) -> None:
    spans = block_spans(64, seed=12)
    before = peer_bytes(remote)
    local.transport.write(local.peer, "kv", "kv", spans)  # not waited on purpose
    local.transport.notify(local.peer, b'{"done": "req-1"}')
    notes = []
    for _ in range(100):  # bounded: 100 x 0.05 s
        notes = remote.proc.call("drain")
        if notes:
            break
        time.sleep(0.05)
    assert notes == [(local.transport.engine_id, b'{"done": "req-1"}')]
    assert np.array_equal(peer_bytes(remote), expect_after(before, local.buf, spans, dst_col=1))
    assert local.transport.stats.totals().notifications_sent == 1


def test_peer_notifies_us_with_binary_payload(local: Local, remote: Remote) -> None:
    peer_id = TransportDescriptor.from_bytes(remote.descriptor).engine_id
    payload = bytes(range(256))
    remote.proc.call("notify", local.transport.engine_id, payload)
    notes = []
    for _ in range(100):
        notes = local.transport.drain_notifications()
        if notes:
            break
        time.sleep(0.05)
    assert [(n.sender, n.payload) for n in notes] == [(peer_id, payload)]
    assert local.transport.stats.totals().notifications_received == 1


def test_peer_can_write_into_us(local: Local, remote: Remote) -> None:
    spans = [(0, 8192, 4096), (12288, 0, 4096)]
    remote.proc.call("write", local.transport.engine_id, "kv", "kv", spans, WAIT_S)
    src = pattern(PEER_SEED, REGION)
    assert np.array_equal(local.buf[8192:12288], src[0:4096])
    assert np.array_equal(local.buf[0:4096], src[12288:16384])


def test_tensor_regions(backend: str, local: Local, remote: Remote) -> None:
    need("torch", why="register_tensor takes a torch tensor")
    import torch

    t = torch.arange(4096, dtype=torch.int32)  # 16 KiB
    local.transport.register_tensor("tensor", t)
    with pytest.raises(RegistrationError):
        local.transport.register_tensor("strided", torch.zeros(8, 8)[:, ::2])
    local.transport.write(local.peer, "tensor", "kv", [(0, 0, t.numel() * 4)]).wait(WAIT_S)
    got = np.frombuffer(remote.proc.call("bytes", "kv", 0, 16384), dtype=np.int32)
    assert np.array_equal(got, np.arange(4096, dtype=np.int32))


def test_wait_times_out_while_the_peer_is_stopped(local: Local, remote: Remote) -> None:
    big = 64 << 20  # far more than loopback socket buffers hold
    desc = remote.proc.call("register", "big", big, 3)
    src = np.ones(big, dtype=np.uint8)
    local.transport.register_buffer("big", src.ctypes.data, big, owner=src)
    local.transport.connect(desc)
    remote.proc.pause()
    try:
        handle = local.transport.write(local.peer, "big", "big", [(0, 0, big)])
        with pytest.raises(TransferTimeout):
            handle.wait(0.5)
        assert handle.poll() is TransferState.PENDING
        assert local.transport.stats.totals().timeouts == 1
    finally:
        remote.proc.resume()
    handle.wait(WAIT_S)
    head = np.frombuffer(remote.proc.call("bytes", "big", 0, 1 << 20), dtype=np.uint8)
    tail = np.frombuffer(remote.proc.call("bytes", "big", big - (1 << 20), big), dtype=np.uint8)
    assert head.min() == 1 and tail.max() == 1


def test_transfer_to_a_dead_peer_fails(backend: str) -> None:
    proc = PeerProcess(backend)
    transport = make_transport(backend)
    try:
        buf = np.zeros(1 << 20, dtype=np.uint8)
        transport.register_buffer("kv", buf.ctypes.data, buf.nbytes, owner=buf)
        peer = transport.connect(proc.call("register", "kv", 1 << 20, 5))
        proc.stop()
        handle = transport.write(peer, "kv", "kv", [(0, 0, 1 << 20)])
        with pytest.raises(TransferError) as err:
            handle.wait(WAIT_S)
        assert not isinstance(err.value, TransferTimeout)
        assert handle.state is TransferState.FAILED and handle.error
        assert transport.stats.totals().failures == 1
    finally:
        proc.stop()
        transport.close()


def test_connect_to_a_dead_peer_is_refused(backend: str, local: Local) -> None:
    if backend not in ("mooncake", "tcp", "cma"):
        not_applicable("only mooncake, tcp and cma reach the peer in connect()")
    desc = local.transport.descriptor().to_dict()
    if backend == "cma":  # its same-host socket is gone too
        desc["extra"]["cma_socket"] = "/nonexistent/data"
    dead = TransportDescriptor.from_dict({**desc, "engine_id": "x", "address": "127.0.0.1:1"})
    with pytest.raises(PeerUnreachable):
        local.transport.connect(dead)
