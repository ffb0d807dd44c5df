"""A transport in a second process, driven over a pipe: the remote side of contract tests;
and a raw ``tcp``-backend client written from the wire format (what an attacker would send).

The child owns named numpy buffers registered with its transport and answers commands;
the parent-side :class:`PeerProcess` sends them with a bounded wait for every reply.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
from typing import Any

import numpy as np

REPLY_TIMEOUT_S = 60.0


def pattern(seed: int, size: int) -> np.ndarray:
    """Deterministic bytes for a buffer."""
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def raw_tcp_hello(
    s: socket.socket, key: bytes | None = None, proof: bytes | None = None, me: bytes = b"x"
):
    """A raw client's HELLO, written from the wire format: our id ``me`` and nonce, the
    server's HELLO, our proof (under ``key``, zeros without one, or ``proof`` as given); the
    server's verdict ``(kind, message)``."""
    from vllm_pd_ext import fleet_key
    from vllm_pd_ext.transport import tcp

    s.settimeout(5)
    nonce = bytes(range(16))
    s.sendall(tcp._HELLO.pack(b"PDXT", 2, len(me)) + me + nonce)
    magic, version, n = tcp._HELLO.unpack(recv_exact(s, tcp._HELLO.size))
    assert (magic, version) == (b"PDXT", 2)
    server_id, server_nonce, _ = recv_exact(s, n), recv_exact(s, 16), recv_exact(s, 32)
    if proof is None:
        proof = (
            fleet_key.tag(key, "tcp hello client", nonce, server_nonce, me, server_id)
            if key
            else bytes(32)
        )
    s.sendall(proof)
    kind, msg_len, _, _ = tcp._RSP.unpack(recv_exact(s, tcp._RSP.size))
    return kind, recv_exact(s, msg_len).decode()


def _raw_tcp_answer(s: socket.socket, xid: int) -> tuple[int, str, bytes]:
    from vllm_pd_ext.transport import tcp

    kind, msg_len, got, nbytes = tcp._RSP.unpack(recv_exact(s, tcp._RSP.size))
    assert got == xid
    message = recv_exact(s, msg_len).decode() if msg_len else ""
    return kind, message, recv_exact(s, nbytes) if nbytes else b""


def raw_tcp_read(s: socket.socket, region: str, spans: Any, xid: int = 1):
    """A raw READ of ``(offset, length)`` spans of ``region`` after a passed HELLO: the
    answer's ``(kind, message, payload)``."""
    from vllm_pd_ext.transport import tcp

    name, pairs = region.encode(), np.asarray(spans, dtype="<i8").reshape(-1, 2)
    s.sendall(tcp._REQ.pack(tcp._READ, len(name), xid, len(pairs), 0) + name + pairs.tobytes())
    return _raw_tcp_answer(s, xid)


def raw_tcp_write(s: socket.socket, region: str, spans: Any, fill: int, xid: int = 1):
    """A raw WRITE of bytes ``fill`` into ``(offset, length)`` spans of ``region`` after a
    passed HELLO: the answer's ``(kind, message)``."""
    from vllm_pd_ext.transport import tcp

    name, pairs = region.encode(), np.asarray(spans, dtype="<i8").reshape(-1, 2)
    n = int(pairs[:, 1].sum())
    head = tcp._REQ.pack(tcp._WRITE, len(name), xid, len(pairs), n) + name + pairs.tobytes()
    s.sendall(head + bytes([fill]) * n)
    return _raw_tcp_answer(s, xid)[:2]


def recv_exact(s: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes from ``s`` (an assertion error if the other side hangs up first)."""
    data = b""
    while len(data) < n:
        more = s.recv(n - len(data))
        assert more, "the server hung up"
        data += more
    return data


def _drop_ptrace() -> None:
    """Clear CAP_SYS_PTRACE from this thread's effective set (threads started later inherit
    it): another process's memory is then reachable only where ptrace's rules allow."""
    import ctypes

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [(n, ctypes.c_uint32) for n in ("effective", "permitted", "inheritable")]

    libc = ctypes.CDLL(None, use_errno=True)
    header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3
    if libc.capget(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    data[0].effective &= ~(1 << 19)  # CAP_SYS_PTRACE
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def _undumpable() -> None:
    """prctl(PR_SET_DUMPABLE, 0): only a process with CAP_SYS_PTRACE may attach to this one."""
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl")


#: What a peer process may do to itself before it makes its transport.
SETUPS = {"drop_ptrace": _drop_ptrace, "undumpable": _undumpable}


def _serve(conn: Any, backend: str, setup: str | None = None) -> None:
    from tests.unit.transport.backends import make_transport

    if setup is not None:
        SETUPS[setup]()
    transport = make_transport(backend)
    buffers: dict[str, np.ndarray] = {}
    while True:
        try:
            cmd, args = conn.recv()
        except EOFError:
            break
        try:
            if cmd == "exit":
                transport.close()
                conn.send(("ok", None))
                break
            result = _handle(transport, buffers, cmd, args)
            conn.send(("ok", result))
        except Exception as e:  # report to the parent, keep serving
            conn.send(("err", (type(e).__name__, str(e))))


def _handle(transport: Any, buffers: dict[str, np.ndarray], cmd: str, args: tuple) -> Any:
    if cmd == "register":
        name, size, seed = args
        buf = pattern(seed, size)
        buffers[name] = buf
        transport.register_buffer(name, buf.ctypes.data, buf.nbytes, owner=buf)
        return transport.descriptor().to_bytes()
    if cmd == "descriptor":
        return transport.descriptor().to_bytes()
    if cmd == "connect":
        return transport.connect(args[0])
    if cmd == "bytes":
        name, start, stop = args
        return buffers[name][start:stop].tobytes()
    if cmd == "fill":
        name, seed = args
        buffers[name][:] = pattern(seed, buffers[name].nbytes)
        return None
    if cmd == "write":
        peer, local, remote, spans, timeout = args
        transport.write(peer, local, remote, spans).wait(timeout)
        return None
    if cmd == "read":
        peer, local, remote, spans, timeout = args
        transport.read(peer, local, remote, spans).wait(timeout)
        return None
    if cmd == "paths":
        return transport.paths()
    if cmd == "pid":
        return os.getpid()
    if cmd == "notify":
        peer, payload = args
        transport.notify(peer, payload)
        return None
    if cmd == "drain":
        return [(n.sender, n.payload) for n in transport.drain_notifications()]
    if cmd == "unregister":
        transport.unregister(args[0])
        buffers.pop(args[0], None)
        return None
    if cmd == "close":
        transport.close()
        return None
    raise ValueError(f"unknown command {cmd!r}")


class PeerError(RuntimeError):
    """The peer process raised; ``kind`` is the exception's class name."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


class PeerProcess:
    """Parent-side handle of a peer process (spawned, so no state is inherited)."""

    def __init__(self, backend: str, setup: str | None = None) -> None:
        """``setup``: one of :data:`SETUPS`, run in the peer before it makes its transport."""
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, backend, setup), daemon=True)
        self.process.start()
        child.close()

    def call(self, cmd: str, *args: Any, timeout: float = REPLY_TIMEOUT_S) -> Any:
        """Run ``cmd`` in the peer and return its result; bounded by ``timeout``."""
        self._conn.send((cmd, args))
        if not self._conn.poll(timeout):
            raise TimeoutError(f"peer did not answer {cmd!r} within {timeout}s")
        status, value = self._conn.recv()
        if status == "err":
            raise PeerError(*value)
        return value

    def pause(self) -> None:
        """SIGSTOP the peer: its engine stops serving until :meth:`resume`."""
        assert self.process.pid is not None  # started
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process.pid is not None  # started
        os.kill(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        """Ask the peer to exit; kill it if it does not within a few seconds."""
        if self.process.is_alive():
            try:
                self.resume()
                self.call("exit", timeout=10)
            except (TimeoutError, OSError, EOFError, PeerError):
                pass
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self._conn.close()
