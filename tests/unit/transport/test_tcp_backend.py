"""The ``tcp`` backend beyond the contract: big and many-span transfers byte for byte, the
receiver's own checks, a peer that dies or stalls mid-transfer (an error, never a hang)."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pydantic
import pytest

from tests.skips import need
from tests.unit.slow_peers import closed_within, connect_from
from tests.unit.transport.peer import PeerProcess, pattern, raw_tcp_hello, recv_exact
from vllm_pd_ext.transport import (
    RegistrationError,
    TransferError,
    TransferState,
    TransferTimeout,
    Transport,
    TransportDescriptor,
    TransportError,
    get_backend,
    tcp,
)

WAIT_S = 60.0
BIG = 64 << 20
KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))


@pytest.fixture(scope="module")
def peer() -> Iterator[PeerProcess]:
    proc = PeerProcess("tcp")
    try:
        yield proc
    finally:
        proc.stop()


def _local(**settings: object) -> Transport:
    return get_backend("tcp", host="127.0.0.1", **settings)


def _pair(peer: PeerProcess, name: str, size: int, seed: int, **settings: object):
    """A local tcp transport with region ``name`` (pattern ``seed + 1``) connected both ways
    to ``peer``'s region ``name`` (pattern ``seed``)."""
    desc = peer.call("register", name, size, seed)
    t = _local(**settings)
    buf = pattern(seed + 1, size)
    t.register_buffer(name, buf.ctypes.data, buf.nbytes, owner=buf)
    pid = t.connect(desc)
    peer.call("connect", t.descriptor().to_bytes())
    return t, buf, pid


def _peer_bytes(peer: PeerProcess, name: str, size: int) -> np.ndarray:
    return np.frombuffer(peer.call("bytes", name, 0, size), dtype=np.uint8)


def test_large_write_and_read_byte_for_byte(peer: PeerProcess) -> None:
    t, buf, pid = _pair(peer, "large", BIG, 20)
    try:
        half = BIG // 2
        # the first half of ours -> the second half of theirs, in three spans of odd sizes
        cuts = [0, 7 << 20, (19 << 20) + 3, half]
        spans = [(a, half + a, b - a) for a, b in itertools.pairwise(cuts)]
        t.write(pid, "large", "large", spans).wait(WAIT_S)
        got = _peer_bytes(peer, "large", BIG)
        assert np.array_equal(got[half:], buf[:half])
        assert np.array_equal(got[:half], pattern(20, BIG)[:half])
        # read all of theirs back into ours
        t.read(pid, "large", "large", [(0, 0, BIG)]).wait(WAIT_S)
        assert np.array_equal(buf, got)
        totals = t.stats.totals()
        assert (totals.transfers, totals.bytes, totals.failures) == (2, half + BIG, 0)
    finally:
        t.close()
        peer.call("unregister", "large")


def test_many_small_scattered_spans(peer: PeerProcess) -> None:
    size, n, length = 8 << 20, 20_000, 96  # many sendmsg/recvmsg batches, odd lengths
    t, buf, pid = _pair(peer, "small", size, 30)
    try:
        rng = np.random.default_rng(3)
        slots = size // 128
        src = rng.permutation(slots)[:n] * 128
        dst = rng.permutation(slots)[:n] * 128 + 5  # unaligned destinations
        spans = np.stack([src, dst, np.full(n, length)], axis=1)
        before = _peer_bytes(peer, "small", size)
        h = t.write(pid, "small", "small", spans)
        h.wait(WAIT_S)
        assert h.posted_spans == n
        want = before.copy()
        for s, d in zip(src.tolist(), dst.tolist(), strict=True):
            want[d : d + length] = buf[s : s + length]
        assert np.array_equal(_peer_bytes(peer, "small", size), want)
        # and back: read their spans into fresh local offsets
        back = np.stack([dst - 5, dst, np.full(n, length)], axis=1)
        t.read(pid, "small", "small", back).wait(WAIT_S)
        for d in dst[:200].tolist():
            assert np.array_equal(buf[d - 5 : d - 5 + length], want[d : d + length])
    finally:
        t.close()
        peer.call("unregister", "small")


def test_receiver_refuses_a_region_it_no_longer_has(peer: PeerProcess) -> None:
    t, buf, pid = _pair(peer, "gone", 1 << 20, 40)
    desc = peer.call("register", "stays", 1 << 20, 41)
    t.connect(desc)  # same peer, newer descriptor: the connection is kept
    try:
        peer.call("unregister", "gone")  # our descriptor of the peer is now stale
        w = t.write(pid, "gone", "gone", [(0, 0, 1 << 20)])
        with pytest.raises(TransferError, match="refused"):
            w.wait(WAIT_S)
        r = t.read(pid, "gone", "gone", [(0, 0, 4096)])
        with pytest.raises(TransferError, match="refused"):
            r.wait(WAIT_S)
        # the stream stayed in step: the same connection still moves bytes
        t.write(pid, "gone", "stays", [(0, 4096, 8192)]).wait(WAIT_S)
        got = np.frombuffer(peer.call("bytes", "stays", 4096, 4096 + 8192), dtype=np.uint8)
        assert np.array_equal(got, buf[:8192])
        assert t.stats.totals().failures == 2
    finally:
        t.close()
        peer.call("unregister", "stays")


def test_disconnect_lets_pending_transfers_finish(peer: PeerProcess) -> None:
    t, buf, pid = _pair(peer, "disc", 16 << 20, 50)
    try:
        h = t.write(pid, "disc", "disc", [(0, 0, 16 << 20)])
        t.disconnect(pid)
        h.wait(WAIT_S)
        assert h.state is TransferState.DONE
        assert np.array_equal(_peer_bytes(peer, "disc", 16 << 20), buf)
    finally:
        t.close()
        peer.call("unregister", "disc")


def test_peer_killed_mid_transfer_fails_not_hangs() -> None:
    proc = PeerProcess("tcp")
    t = _local()
    try:
        src = np.ones(BIG, dtype=np.uint8)
        t.register_buffer("kv", src.ctypes.data, BIG, owner=src)
        pid = t.connect(proc.call("register", "kv", BIG, 6))
        proc.pause()  # it cannot finish: we are mid-transfer when the peer dies
        h = t.write(pid, "kv", "kv", [(0, 0, BIG)])
        with pytest.raises(TransferTimeout):
            h.wait(0.3)
        proc.process.kill()
        t0 = time.monotonic()
        with pytest.raises(TransferError) as err:
            h.wait(WAIT_S)
        assert not isinstance(err.value, TransferTimeout)
        assert time.monotonic() - t0 < 10
        assert h.state is TransferState.FAILED and "lost" in (h.error or "")
        # later transfers fail at once too (reconnecting is refused), never hang
        h2 = t.write(pid, "kv", "kv", [(0, 0, 4096)])
        with pytest.raises(TransferError):
            h2.wait(10)
    finally:
        proc.stop()
        t.close()


def test_a_stalled_peer_fails_within_io_timeout(peer: PeerProcess) -> None:
    t, _, pid = _pair(peer, "stall", BIG, 60, io_timeout_s=1.0)
    peer.pause()
    try:
        with pytest.raises(TransferTimeout):
            t.notify(pid, b"x", timeout=0.3)  # bounded by its own timeout
        h = t.write(pid, "stall", "stall", [(0, 0, BIG)])
        t0 = time.monotonic()
        with pytest.raises(TransferError) as err:
            h.wait(WAIT_S)
        assert not isinstance(err.value, TransferTimeout)
        assert time.monotonic() - t0 < 15
        assert "no data" in (h.error or "")
    finally:
        peer.resume()
        t.close()
        peer.call("unregister", "stall")


def test_garbage_on_the_data_port_is_dropped(peer: PeerProcess) -> None:
    t, buf, pid = _pair(peer, "junk", 1 << 20, 70)
    try:
        host, _, port = TransportDescriptor.from_bytes(peer.call("descriptor")).address.rpartition(
            ":"
        )
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(b"GET / HTTP/1.1\r\n\r\n")
            s.settimeout(5)
            # the server hangs up on a stranger (a reset when our junk was left unread)
            with contextlib.suppress(ConnectionResetError):
                assert s.recv(64) == b""
        t.write(pid, "junk", "junk", [(0, 0, 4096)]).wait(WAIT_S)
        assert np.array_equal(_peer_bytes(peer, "junk", 4096), buf[:4096])
    finally:
        t.close()
        peer.call("unregister", "junk")


def test_settings_and_host_memory_only() -> None:
    with pytest.raises(pydantic.ValidationError, match="bogus"):
        get_backend("tcp", bogus=1)
    t = _local()
    try:
        port = int(t.descriptor().address.rpartition(":")[2])
        with pytest.raises(TransportError, match="bind"):
            _local(port=port)
        need("torch", why="register_tensor takes a torch tensor")
        import torch

        with pytest.raises(RegistrationError, match="host memory"):
            t.register_tensor("meta", torch.empty(16, device="meta"))
    finally:
        t.close()


@pytest.mark.parametrize(
    "span",
    [
        ((1 << 63) - 8, 16),  # offset + length wraps to a negative int64
        (8, (1 << 63) - 1),
        (-1, 8),
        (0, 4097),
    ],
)
def test_a_span_outside_the_region_is_refused_however_it_is_written(span) -> None:
    """A raw peer asks to READ a span whose int64 offset + length wraps around (or that
    plainly leaves the region): the server answers FAIL and sends no data."""
    t = _local()
    buf = pattern(5, 4096)
    t.register_buffer("r", buf.ctypes.data, buf.nbytes, owner=buf)
    try:
        port = int(t.descriptor().address.rpartition(":")[2])
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            assert raw_tcp_hello(s) == (tcp._OK, "")
            spans = np.array([span], dtype="<i8").tobytes()
            s.sendall(tcp._REQ.pack(tcp._READ, 1, 7, 1, 0) + b"r" + spans)
            kind, msg_len, xid, nbytes = tcp._RSP.unpack(recv_exact(s, tcp._RSP.size))
            message = recv_exact(s, msg_len).decode()
        assert (kind, xid, nbytes) == (tcp._FAIL, 7, 0), message
        assert "leaves the region" in message
    finally:
        t.close()


def _port(t: Transport) -> int:
    return int(t.descriptor().address.rpartition(":")[2])


def _served(server: Transport, **settings: object) -> None:
    """A fresh transport (``settings``: its key) writes 4 KiB into ``server``'s region
    ``"dst"`` and reads them back, byte for byte."""
    client = _local(**settings)
    src, back = pattern(9, 4096), np.zeros(4096, dtype=np.uint8)
    try:
        client.register_buffer("src", src.ctypes.data, src.nbytes, owner=src)
        client.register_buffer("back", back.ctypes.data, back.nbytes, owner=back)
        peer = client.connect(server.descriptor())
        client.write(peer, "src", "dst", [(0, 0, 4096)]).wait(WAIT_S)
        client.read(peer, "back", "dst", [(0, 0, 4096)]).wait(WAIT_S)
        assert (back == src).all()
    finally:
        client.close()


def _serving(**settings: object) -> tcp.TcpTransport:
    """A tcp transport with a 4 KiB region ``"dst"``."""
    t = _local(**settings)
    assert isinstance(t, tcp.TcpTransport)
    dst = np.zeros(4096, dtype=np.uint8)
    t.register_buffer("dst", dst.ctypes.data, dst.nbytes, owner=dst)
    return t


def test_connections_beyond_the_cap_are_closed_at_once() -> None:
    """Each served connection costs a thread: once ``max_connections`` peers are past their
    HELLO the server closes new connections as they come, and serves again once one goes."""
    t = _serving(max_connections=2)
    try:
        port = _port(t)
        held = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(2)]
        for s in held:
            assert raw_tcp_hello(s) == (tcp._OK, "")
        with socket.create_connection(("127.0.0.1", port), timeout=5) as extra:
            assert closed_within(extra, 10)  # unanswered: no slot, none still in its HELLO
        assert t._server.slots.refused == 1
        held.pop().close()
        deadline = time.monotonic() + 10
        while True:  # the server notices the closed one, then serves again
            try:
                _served(t)
                break
            except TransportError:  # refused before its thread released the slot
                assert time.monotonic() < deadline, "never served again"
                time.sleep(0.05)
        for s in held:
            s.close()
    finally:
        t.close()


def test_a_hello_trickled_byte_by_byte_is_closed_at_the_hello_deadline() -> None:
    """A peer without the key sends its HELLO one byte every 0.1 s, far within the per-read
    stall timeout: it is closed once ``hello_timeout_s`` (from its accept) has passed, and a
    keyed peer is served afterwards."""
    t = _serving(key=KEY, hello_timeout_s=0.5, io_timeout_s=60)
    try:
        hello = tcp._HELLO.pack(tcp._MAGIC, tcp._VERSION, 1000) + b"x" * 1000 + bytes(16)
        with socket.create_connection(("127.0.0.1", _port(t)), timeout=5) as slow:
            assert closed_within(slow, 10, trickle=hello)
        assert t._server.slots.closed == 1
        _served(t, key=KEY)
    finally:
        t.close()


def test_one_address_gets_at_most_max_per_source_connections() -> None:
    """Six connections from one address that never send their HELLO: ``max_per_source`` of
    them are held, the rest closed at once, and a keyed peer from another address (which,
    without the cap, would find every slot taken) connects and transfers."""
    t = _serving(key=KEY, max_connections=4, max_per_source=2, hello_timeout_s=60)
    attackers = connect_from("127.0.0.2", _port(t), 6)
    try:
        for s in attackers[2:]:
            assert closed_within(s, 10)
        _served(t, key=KEY)  # from 127.0.0.1
        assert t._server.slots.refused == 4 and t._server.slots.closed == 0
    finally:
        for s in attackers:
            s.close()
        t.close()


def test_when_full_the_oldest_connection_still_in_its_hello_makes_room() -> None:
    """Connections from four addresses take every slot and never send their HELLO: a keyed
    peer is still served, and the oldest of them is closed for it."""
    t = _serving(key=KEY, max_connections=4, max_per_source=1, hello_timeout_s=60)
    attackers = [s for i in range(4) for s in connect_from(f"127.0.0.{2 + i}", _port(t))]
    try:
        _served(t, key=KEY)
        assert closed_within(attackers[0], 10)
        assert t._server.slots.closed == 1 and t._server.slots.refused == 0
    finally:
        for s in attackers:
            s.close()
        t.close()


def test_a_peer_past_its_hello_is_no_longer_under_the_hello_deadline() -> None:
    """The HELLO deadline bounds only the unauthenticated phase: once a peer proved the key
    its connection leaves the slots' head phase (which alone has a deadline) and serves on."""
    t = _serving(key=KEY, hello_timeout_s=0.2)
    client = _local(key=KEY)
    src = pattern(3, 4096)
    try:
        client.register_buffer("src", src.ctypes.data, src.nbytes, owner=src)
        peer = client.connect(t.descriptor())
        client.write(peer, "src", "dst", [(0, 0, 4096)]).wait(WAIT_S)
        assert (t._server.slots.held(), t._server.slots.in_head()) == (1, 0)
    finally:
        client.close()
        t.close()


def test_peers_holding_the_fleet_key_write_read_and_notify() -> None:
    a, b = _local(key=KEY), _local(key=KEY)
    src, dst = pattern(1, 8192), np.zeros(8192, dtype=np.uint8)
    back = np.zeros(4096, dtype=np.uint8)
    try:
        a.register_buffer("src", src.ctypes.data, src.nbytes, owner=src)
        a.register_buffer("back", back.ctypes.data, back.nbytes, owner=back)
        b.register_buffer("dst", dst.ctypes.data, dst.nbytes, owner=dst)
        peer = a.connect(b.descriptor())
        a.wait(a.write(peer, "src", "dst", [(0, 0, 8192)]), WAIT_S)
        assert (dst == src).all()
        a.wait(a.read(peer, "back", "dst", [(0, 4096, 4096)]), WAIT_S)
        assert (back == src[4096:]).all()
        a.notify(peer, b"done")
        deadline = time.monotonic() + WAIT_S
        while not (notes := b.drain_notifications()):
            assert time.monotonic() < deadline, "the notification never arrived"
            time.sleep(0.01)
        assert [(n.sender, n.payload) for n in notes] == [(a.engine_id, b"done")]
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("proof", ["zeros", "other key", "replayed"])
def test_a_raw_peer_without_the_fleet_key_can_neither_read_write_nor_notify(proof) -> None:
    """An attacker's socket speaks the HELLO without the key (no proof, a proof under another
    key, or a valid proof recorded from another connection): the server says why it refuses,
    closes, and then a READ, a WRITE and a NOTIFY sent anyway get no answer and change nothing."""
    from vllm_pd_ext import fleet_key

    refused: list[int] = []
    t = _local(key=KEY, on_refused=lambda: refused.append(1))
    buf = pattern(5, 4096)
    t.register_buffer("r", buf.ctypes.data, buf.nbytes, owner=buf)
    port = int(t.descriptor().address.rpartition(":")[2])
    try:
        given = {"zeros": bytes(32), "other key": None, "replayed": None}[proof]
        if proof == "replayed":  # a valid proof for an earlier connection's nonces
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                assert raw_tcp_hello(s, key=KEY) == (tcp._OK, "")
            given = fleet_key.tag(KEY, "tcp hello client", bytes(range(16)), bytes(16), b"x", b"")
        key = OTHER_KEY if proof == "other key" else None
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            kind, message = raw_tcp_hello(s, key=key, proof=given)
            assert kind == tcp._FAIL and "no proof of the fleet key" in message
            span = np.array([(0, 64)], dtype="<i8").tobytes()
            with contextlib.suppress(OSError):
                s.sendall(tcp._REQ.pack(tcp._READ, 1, 1, 1, 0) + b"r" + span)
                s.sendall(tcp._REQ.pack(tcp._WRITE, 1, 2, 1, 64) + b"r" + span + bytes(64))
                s.sendall(tcp._REQ.pack(tcp._NOTIFY, 0, 3, 0, 4) + b"done")
            with contextlib.suppress(ConnectionResetError):
                assert s.recv(1) == b"", "the server answered after refusing the HELLO"
        assert (buf == pattern(5, 4096)).all()
        assert t.drain_notifications() == []
        assert refused == [1]
    finally:
        t.close()


@pytest.mark.parametrize(
    ("client_key", "server_key", "why"),
    [
        (KEY, None, "did not prove it holds the fleet key"),
        (None, KEY, "authenticates with a fleet key and this engine has none"),
        (KEY, OTHER_KEY, "did not prove it holds the fleet key"),
    ],
    ids=["keyless server", "keyless client", "different keys"],
)
def test_transports_with_different_keys_do_not_connect(client_key, server_key, why) -> None:
    from vllm_pd_ext.transport import PeerMismatch

    client, server = _local(key=client_key), _local(key=server_key)
    try:
        with pytest.raises(PeerMismatch, match=why):
            client.connect(server.descriptor())
    finally:
        client.close()
        server.close()


def test_a_connect_waiting_on_a_silent_peer_does_not_hold_up_draining_notifications() -> None:
    """A connector drains notifications on the engine's step, while its transfer threads
    connect to peers: a connect waiting for the HELLO of a peer that accepted the connection
    but never answers (a wedged engine) must not stop the drain (the engine's step) until
    the connect gives up."""
    silent = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    acceptor = threading.Thread(target=lambda: accepted.append(silent.accept()[0]))
    acceptor.start()
    t, other = _local(connect_timeout_s=120.0), _local()
    port = silent.getsockname()[1]
    target = dataclasses.replace(other.descriptor(), address=f"127.0.0.1:{port}")
    failed: list[Exception] = []

    def connect() -> None:
        try:
            t.connect(target)
        except TransportError as e:
            failed.append(e)

    connecting = threading.Thread(target=connect)
    drained: list[object] = []
    draining = threading.Thread(target=lambda: drained.append(t.drain_notifications()))
    try:
        connecting.start()
        acceptor.join(WAIT_S)
        assert accepted, "the connect never reached the silent peer"
        draining.start()
        draining.join(WAIT_S)  # bounded: the assertions below say whether it was held up
        assert drained == [[]]
        assert connecting.is_alive()  # still waiting for the HELLO
    finally:
        for s in accepted:
            s.close()  # the connect fails now
        connecting.join(WAIT_S)
        draining.join(WAIT_S)
        t.close()
        other.close()
        silent.close()
    assert failed and isinstance(failed[0], TransportError)
