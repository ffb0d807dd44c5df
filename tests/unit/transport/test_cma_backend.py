"""The ``cma`` backend beyond the contract: payloads by cross-memory attach between processes
on one host, the server's own idea of who the requester is (``SO_PEERCRED``, never the
offer), grants and bounds on CMA requests exactly as on tcp's, and the counted fallback to
the socket when the kernel refuses or the peer is elsewhere."""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import tempfile
import time
from collections.abc import Iterator

import numpy as np
import pytest

from tests.unit.transport.peer import PeerError, PeerProcess, pattern, raw_tcp_hello, recv_exact
from vllm_pd_ext.transport import TransferOp, TransportDescriptor, get_backend, tcp
from vllm_pd_ext.transport.cma import (
    HOST_KEY,
    SOCKET_KEY,
    CmaTransport,
    offer_frame,
    request_frame,
)

WAIT_S = 60.0
SIZE = 4 << 20
BLOCK = 16 << 10


@pytest.fixture(scope="module")
def peer() -> Iterator[PeerProcess]:
    proc = PeerProcess("cma")
    try:
        yield proc
    finally:
        proc.stop()


def _local(**settings: object) -> CmaTransport:
    t = get_backend("cma", host="127.0.0.1", **settings)
    assert isinstance(t, CmaTransport)
    return t


def _pair(peer: PeerProcess, name: str, seed: int, **settings: object):
    desc = peer.call("register", name, SIZE, seed)
    t = _local(**settings)
    buf = pattern(seed + 1, SIZE)
    t.register_buffer(name, buf.ctypes.data, buf.nbytes, owner=buf)
    pid = t.connect(desc)
    return t, buf, pid, desc


def _peer_bytes(peer: PeerProcess, name: str) -> np.ndarray:
    return np.frombuffer(peer.call("bytes", name, 0, SIZE), dtype=np.uint8)


def _scattered(n: int, seed: int) -> np.ndarray:
    """``n`` 16 KiB spans: blocks 0..n-1 of one side to random distinct blocks of the other."""
    dst = np.random.default_rng(seed).permutation(SIZE // BLOCK)[:n]
    src = np.arange(n)
    return np.stack([src * BLOCK, dst * BLOCK, np.full(n, BLOCK)], axis=1)


@pytest.mark.parametrize("per_call", [1024, 7])
def test_scattered_reads_and_writes_by_cma_byte_for_byte(peer: PeerProcess, per_call) -> None:
    """More spans than one process_vm_* call takes (IOV_MAX), and batches that do not divide
    them: every byte where it belongs, and the connection counted as CMA."""
    t, buf, pid, _ = _pair(peer, f"scatter{per_call}", 30, cma_iov_max=per_call)
    try:
        spans = _scattered(SIZE // BLOCK // 2 + 3, 31)  # 131 spans; coalescing cannot merge
        t.write(pid, f"scatter{per_call}", f"scatter{per_call}", spans).wait(WAIT_S)
        got, want = _peer_bytes(peer, f"scatter{per_call}"), pattern(30, SIZE)
        for src, dst, n in spans:
            want[dst : dst + n] = buf[src : src + n]
        assert np.array_equal(got, want)
        many = np.stack([np.arange(2000) * 512, np.arange(2000)[::-1] * 512, np.full(2000, 256)], 1)
        t.read(pid, f"scatter{per_call}", f"scatter{per_call}", many).wait(WAIT_S)
        for local, remote, n in many:
            assert np.array_equal(buf[local : local + n], got[remote : remote + n])
        assert t.paths() == {"cma": 1, "socket": 0}
        assert t.stats.totals().failures == 0
    finally:
        t.close()


def test_a_peer_on_another_host_is_served_over_tcp_counted_and_logged(
    peer: PeerProcess, caplog: pytest.LogCaptureFixture
) -> None:
    desc = TransportDescriptor.from_bytes(peer.call("register", "elsewhere", SIZE, 40))
    moved = TransportDescriptor.from_dict(
        {**desc.to_dict(), "extra": {**desc.extra, HOST_KEY: "another-boot/1"}}
    )
    t = _local()
    buf = np.zeros(SIZE, dtype=np.uint8)
    t.register_buffer("elsewhere", buf.ctypes.data, buf.nbytes, owner=buf)
    try:
        with caplog.at_level(logging.WARNING, logger="vllm_pd_ext.transport.cma"):
            pid = t.connect(moved)
            t.read(pid, "elsewhere", "elsewhere", [(0, 0, SIZE)]).wait(WAIT_S)
        assert np.array_equal(buf, pattern(40, SIZE))
        assert t.paths() == {"cma": 0, "socket": 1}
        assert t._conns[pid].link.sock.family == socket.AF_INET
        assert "peer on another host" in caplog.text
    finally:
        t.close()


def test_cma_refused_by_the_kernel_falls_back_to_the_socket() -> None:
    """A real EPERM: the serving peer lacks CAP_SYS_PTRACE and the requester is not dumpable,
    so ptrace's rules forbid the attach. The write still lands, over the Unix socket, and
    the requester counts the fallback."""
    server = PeerProcess("cma", setup="drop_ptrace")
    client = PeerProcess("cma", setup="undumpable")
    try:
        desc = server.call("register", "kv", SIZE, 50)
        client.call("register", "kv", SIZE, 51)
        pid = client.call("connect", desc)
        client.call("write", pid, "kv", "kv", [(0, 4096, 65536)], WAIT_S)
        got = np.frombuffer(server.call("bytes", "kv", 0, SIZE), dtype=np.uint8)
        want = pattern(50, SIZE)
        want[4096 : 4096 + 65536] = pattern(51, SIZE)[:65536]
        assert np.array_equal(got, want)
        assert client.call("paths") == {"cma": 0, "socket": 1}
    finally:
        client.stop()
        server.stop()


def test_cma_can_be_turned_off_and_that_is_counted(peer: PeerProcess) -> None:
    t, buf, pid, _ = _pair(peer, "off", 60, cma=False)
    try:
        t.read(pid, "off", "off", [(0, 0, SIZE)]).wait(WAIT_S)
        assert np.array_equal(buf, pattern(60, SIZE))
        assert t.paths() == {"cma": 0, "socket": 1}
        assert t._conns[pid].link.sock.family == socket.AF_UNIX
    finally:
        t.close()


@pytest.mark.parametrize("backend", ["tcp", "cma"])
def test_grants_are_enforced_on_cma_requests_exactly_as_on_tcp(backend: str) -> None:
    """Our server enforces grants; the peer reads and writes it (over CMA for ``cma``)."""
    server = get_backend(backend, host="127.0.0.1")
    mine = pattern(70, SIZE)
    server.register_buffer("kv", mine.ctypes.data, mine.nbytes, owner=mine)
    server.enforce_grants()
    other = PeerProcess(backend)
    try:
        other.call("register", "kv", SIZE, 71)
        pid = other.call("connect", server.descriptor().to_bytes())
        me = server.connect(other.call("descriptor"))
        with pytest.raises(PeerError, match="outside the spans granted"):
            other.call("write", pid, "kv", "kv", [(0, 0, BLOCK)], WAIT_S)
        with pytest.raises(PeerError, match="outside the spans granted"):
            other.call("read", pid, "kv", "kv", [(0, 0, BLOCK)], WAIT_S)
        assert np.array_equal(mine, pattern(70, SIZE))
        assert server.stats.totals().ungranted == 2
        server.grant("g", TransferOp.WRITE, me, {"kv": [(BLOCK, BLOCK)]})
        other.call("write", pid, "kv", "kv", [(0, BLOCK, BLOCK)], WAIT_S)
        assert np.array_equal(mine[BLOCK : 2 * BLOCK], pattern(71, BLOCK))
        # a write granted in part is refused whole
        with pytest.raises(PeerError, match="outside the spans granted"):
            other.call("write", pid, "kv", "kv", [(0, BLOCK, 2 * BLOCK)], WAIT_S)
        assert np.array_equal(mine[2 * BLOCK : 3 * BLOCK], pattern(70, SIZE)[2 * BLOCK : 3 * BLOCK])
        server.revoke("g")
        with pytest.raises(PeerError, match="outside the spans granted"):
            other.call("write", pid, "kv", "kv", [(0, BLOCK, BLOCK)], WAIT_S)
        if backend == "cma":
            assert other.call("paths") == {"cma": 1, "socket": 0}
    finally:
        other.stop()
        server.close()


# ------------------------------------------------------- a raw requester on the Unix socket
def _raw_unix(desc: bytes) -> socket.socket:
    """A raw client on the peer's Unix socket, past tcp's HELLO."""
    d = TransportDescriptor.from_bytes(desc)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(d.extra[SOCKET_KEY])
    assert raw_tcp_hello(s)[0] == tcp._OK
    return s


def _answer(s: socket.socket, xid: int = 0) -> tuple[int, str]:
    kind, msg_len, got, nbytes = tcp._RSP.unpack(recv_exact(s, tcp._RSP.size))
    assert got == xid and nbytes == 0
    return kind, recv_exact(s, msg_len).decode() if msg_len else ""


def _address(desc: bytes, name: str) -> int:
    return TransportDescriptor.from_bytes(desc).region(name).addr


def test_a_requester_declaring_another_pid_is_never_attached_to_that_process(
    peer: PeerProcess,
) -> None:
    """The raw requester says it is a victim process (same user), offers the victim's region
    as its probe (the right token: it knows the victim's bytes) and asks for a READ into the
    victim's region. The server asks the kernel who is connected: no CMA, nothing written."""
    server_desc = peer.call("register", "spoofed", SIZE, 80)
    victim = PeerProcess("cma")
    try:
        victim_desc = victim.call("register", "kv", SIZE, 81)
        victim_pid, victim_addr = victim.call("pid"), _address(victim_desc, "kv")
        assert victim_pid != os.getpid()
        with _raw_unix(server_desc) as s:
            s.sendall(offer_frame(victim_pid, victim_addr, pattern(81, 16).tobytes()))
            kind, reason = _answer(s)
            assert kind == tcp._FAIL and f"the kernel says {os.getpid()}" in reason
            spans = np.array([[0, 0, SIZE]])
            s.sendall(request_frame(4, 7, "spoofed", victim_addr, SIZE, spans))
            kind, reason = _answer(s, 7)
            assert kind == tcp._FAIL and "not agreed" in reason
        got = np.frombuffer(victim.call("bytes", "kv", 0, SIZE), dtype=np.uint8)
        assert np.array_equal(got, pattern(81, SIZE))
    finally:
        victim.stop()


@pytest.fixture(scope="module")
def bounds(peer: PeerProcess) -> bytes:
    """The peer's descriptor with its region "bounds"."""
    return peer.call("register", "bounds", SIZE, 90)


@pytest.mark.parametrize(
    ("kind", "span", "why"),
    [
        (4, (0, BLOCK, BLOCK), "the requester's side"),  # READ past the declared region
        (4, (0, -BLOCK, BLOCK), "the requester's side"),  # READ before it
        (5, (0, BLOCK, BLOCK), "the requester's side"),  # WRITE from past it
        (4, (SIZE - 1, 0, 2), "leaves the region"),  # past the server's region
    ],
)
def test_a_span_outside_the_declared_requester_region_is_refused(
    peer: PeerProcess, bounds: bytes, kind: int, span: tuple[int, int, int], why: str
) -> None:
    """A truthful requester (its own pid, a readable probe) declares the middle block of a
    buffer of three as its region and names a span outside it: refused, and neither side's
    bytes move. The blocks around the declared one are ours and mapped, so a server that
    skipped the check would visibly fill them (or copy their zeros into its region)."""
    peer.call("fill", "bounds", 90)
    probe = ctypes.create_string_buffer(b"0123456789abcdef", 16)
    mine = np.zeros(3 * BLOCK, dtype=np.uint8)
    base = mine.ctypes.data + BLOCK
    with _raw_unix(bounds) as s:
        s.sendall(offer_frame(os.getpid(), ctypes.addressof(probe), probe.raw))
        assert _answer(s) == (tcp._OK, "")
        s.sendall(request_frame(kind, 3, "bounds", base, BLOCK, np.array([span])))
        got_kind, reason = _answer(s, 3)
        assert got_kind == tcp._FAIL and why in reason
        # the same connection still serves a span inside both regions
        s.sendall(request_frame(4, 4, "bounds", base, BLOCK, np.array([[0, 0, BLOCK]])))
        assert _answer(s, 4) == (tcp._OK, "")
    assert np.array_equal(mine[BLOCK : 2 * BLOCK], pattern(90, SIZE)[:BLOCK])
    assert not mine[:BLOCK].any() and not mine[2 * BLOCK :].any()
    got = np.frombuffer(peer.call("bytes", "bounds", 0, SIZE), dtype=np.uint8)
    assert np.array_equal(got, pattern(90, SIZE))


def test_socket_directories_left_by_dead_processes_are_swept(tmp_path) -> None:
    """A new transport removes the socket directories of ours that nobody listens on once
    they are a minute old; a young one, and a live transport's old one, stay."""

    def left_behind(age_s: float) -> str:
        folder = tempfile.mkdtemp(prefix="pdext-cma-", dir=tmp_path)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.bind(os.path.join(folder, "data"))  # bound, then its process is gone
        os.utime(folder, (time.time() - age_s, time.time() - age_s))
        return folder

    stale, young = left_behind(120.0), left_behind(0.0)
    live = _local(socket_dir=str(tmp_path))
    try:
        live_dir = os.path.dirname(
            TransportDescriptor.from_bytes(live.descriptor().to_bytes()).extra[SOCKET_KEY]
        )
        os.utime(live_dir, (time.time() - 120.0, time.time() - 120.0))
        assert not os.path.exists(stale)  # swept by the live one already
        stale = left_behind(120.0)
        newer = _local(socket_dir=str(tmp_path))
        newer.close()
        assert not os.path.exists(stale)
        assert os.path.isdir(young) and os.path.isdir(live_dir)
    finally:
        live.close()
    assert not os.path.exists(live_dir)
