"""Our own KV data path over plain TCP sockets (stdlib + numpy): the ``tcp`` backend.

Why: Mooncake's TCP transport pays a lot per entry, so vLLM's usual per-layer layout with
scattered 16 KiB blocks moves at about a tenth of a plain loopback-TCP copy. Here the kernel
does the gathering and scattering: spans go out with ``sendmsg`` calls of up to ``iov_max``
memoryviews of the registered region (about ``batch_bytes`` each: 512 KiB moved 16 KiB spans
~1.2x faster than 2 MiB and ~1.3x faster than 8 MiB in interleaved A/B runs on loopback) and land
with ``recvmsg_into`` straight into the receiver's region, so every byte is copied exactly
as often as by a plain socket copy (user -> kernel -> user) and Python pays well under a
microsecond per span.

Shape:

* each transport runs one :class:`_Server` (a listening socket on ``host``, one daemon thread
  per accepted connection) that serves peers' requests against its registered regions. Nobody
  can hold its connections (:class:`~vllm_pd_ext.util.conn_slots.ConnectionSlots`): at most
  ``max_connections``, ``max_per_source`` of them from one address; a peer must have passed its
  HELLO (the server's verdict on its proof) ``hello_timeout_s`` after its connection was
  accepted, however it paces its bytes, and when all are taken the oldest connection still in
  its HELLO is closed for a new one. A peer past its HELLO is long-lived: only the
  ``io_timeout_s`` stall rule below ends it;
* each connected peer gets one persistent :class:`_PeerConn`: a writer thread sends requests
  in submission order, a reader thread takes the answers. A WRITE is a header, the
  destination ``(offset, length)`` array and the payload; the receiver checks the region and
  every span's bounds, receives into place, then answers OK (or FAIL after draining the
  payload, so the stream stays in step). A READ is a header and the source spans; the peer
  answers DATA plus the payload, which the reader receives into the local region. ``wait``
  therefore means the bytes are in place on the destination;
* a notification is a NOTIFY frame on the same connection, acknowledged once queued: it
  cannot overtake transfers submitted before it;
* a broken connection (peer gone) fails every pending transfer of that peer with
  :class:`TransferError`; the next transfer reconnects. A peer that makes no progress for
  ``io_timeout_s`` counts as gone. ``wait`` is always bounded by its own timeout.

Wire (little-endian): HELLO ``"PDXT", u16 version, u16 id length, id, 16-byte nonce`` from the
client; the server's HELLO the same plus a 32-byte proof; the client's 32-byte proof; the
server's verdict (an answer frame, OK or FAIL with the reason). Then requests ``u8 kind, u32
name length, u64 transfer id, u64 spans, u64 payload bytes``, name, spans as int64 ``(offset,
length)`` pairs, payload; answers ``u8 kind, u32 message length, u64 transfer id, u64 payload
bytes``, message, payload. Host memory only (CPU tensors or buffers).

With a fleet key (``key=``, :mod:`vllm_pd_ext.fleet_key`) each proof is the HMAC of both
nonces and both ids under the key, labelled by side: a peer that does not hold the key can
neither be served (no read, write or notification gets through) nor pass as a server, and a
recorded HELLO is worthless (fresh nonces each time). Without a key the proofs are zeros and
the data server serves anyone who can reach ``host:port`` (within the regions' bounds), as
Mooncake's and MoRI's engines do: then bind it to a private interface.

Once the transport's ``enforce_grants()`` is on, the server also serves a READ only inside
spans granted for reading to the engine id the connection named at HELLO, and a WRITE only
inside spans granted to it for writing (:mod:`vllm_pd_ext.transport.grants`); anything else is
answered FAIL (a WRITE's payload drained first, nothing written).
"""

from __future__ import annotations

import contextlib
import ctypes
import hmac
import itertools
import logging
import queue
import secrets
import socket
import struct
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from vllm_pd_ext import fleet_key
from vllm_pd_ext.transport.base import (
    MAX_QUEUED_NOTIFICATIONS,
    Notification,
    Region,
    TransferOp,
    TransferState,
    Transport,
    TransportDescriptor,
)
from vllm_pd_ext.transport.errors import (
    PeerMismatch,
    PeerUnreachable,
    RegistrationError,
    TransferError,
    TransferTimeout,
    TransportError,
)
from vllm_pd_ext.transport.spans import LENGTH, LOCAL, REMOTE
from vllm_pd_ext.util.conn_slots import ConnectionSlots
from vllm_pd_ext.util.throttle import Throttle

logger = logging.getLogger(__name__)

_MAGIC, _VERSION = b"PDXT", 2
_HELLO = struct.Struct("<4sHH")
_NONCE, _PROOF = 16, 32
_NO_PROOF = bytes(_PROOF)
_REQ = struct.Struct("<BIQQQ")  # kind, name length, transfer id, spans, payload bytes
_RSP = struct.Struct("<BIQQ")  # kind, message length, transfer id, payload bytes
_WRITE, _READ, _NOTIFY = 1, 2, 3
_OK, _DATA, _FAIL = 1, 2, 3
_MAX_NAME = 4096
_MAX_MESSAGE = 64 * 1024
#: Receive timeout of one blocking call: how often idle threads look at their stop flag.
_POLL_S = 0.25
_DRAIN_CHUNK = 1 << 20
#: Refused peers are logged at most this often.
_REFUSAL_LOG_EVERY_S = 10.0


class TcpConfig(BaseModel):
    """Settings of the ``tcp`` backend (``get_backend("tcp", **settings)``)."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="IP the data server binds and advertises.")
    port: int = Field(0, ge=0, le=65535, description="Data server port; 0 picks a free one.")
    connect_timeout_s: float = Field(5.0, gt=0, description="Connect + hello with a peer.")
    io_timeout_s: float = Field(
        30.0, gt=0, description="A peer that moves no byte for this long counts as gone."
    )
    iov_max: int = Field(512, ge=1, le=1024, description="Spans per sendmsg/recvmsg call.")
    batch_bytes: int = Field(
        512 << 10, ge=4096, description="Bytes per sendmsg/recvmsg call (a longer span: one call)."
    )
    socket_buffer_bytes: int | None = Field(
        None, ge=65536, description="SO_SNDBUF/SO_RCVBUF; None keeps the kernel's autotuning."
    )
    coalesce: bool = Field(True, description="Merge spans adjacent on both sides.")
    max_connections: int = Field(
        256,
        ge=1,
        description="Peer connections the data server serves at once (a thread each); beyond "
        "it, the oldest one still in its HELLO is closed for a new one, or the new one is.",
    )
    max_per_source: int = Field(
        128, ge=1, description="Data connections from one address at once; more are closed."
    )
    hello_timeout_s: float = Field(
        5.0,
        gt=0,
        description="A data connection must have passed its HELLO (a verified proof of the "
        "fleet key) this long after it was accepted, or it is closed.",
    )
    max_spans: int = Field(
        1 << 24,
        ge=1,
        description="Spans in one request, sent or served (the server reads 16 bytes of span "
        "table per span before it checks them).",
    )
    max_notify_bytes: int = Field(
        64 << 10, ge=1, description="Largest notification payload, sent or received."
    )


class _Stalled(OSError):
    """No byte moved for ``io_timeout_s``."""


class _Refused(ValueError):
    """A peer that could not prove the fleet key."""


class _Closed(OSError):
    """The other side closed the connection, or we are shutting down."""


# ---------------------------------------------------------------------------- socket I/O
def _timeval(seconds: float) -> bytes:
    sec = int(seconds)
    return struct.pack("ll", sec, int((seconds - sec) * 1e6))


def _tune(sock: socket.socket, cfg: TcpConfig) -> None:
    """Blocking socket; sends give up after ``io_timeout_s``, receives wake every _POLL_S."""
    sock.settimeout(None)
    if sock.family != socket.AF_UNIX:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(cfg.io_timeout_s))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(_POLL_S))
    if cfg.socket_buffer_bytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, cfg.socket_buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, cfg.socket_buffer_bytes)


class _Link:
    """Exact-size sends and receives on one blocking socket, with stall detection."""

    def __init__(self, sock: socket.socket, cfg: TcpConfig, stop: threading.Event) -> None:
        self.sock = sock
        self.cfg = cfg
        self.stop = stop
        self.last_progress = time.monotonic()

    # sends: SO_SNDTIMEO makes a send that moves nothing for io_timeout_s fail
    def send(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            try:
                n = self.sock.send(view)
            except (BlockingIOError, TimeoutError) as e:
                raise _Stalled(f"peer accepted no data for {self.cfg.io_timeout_s:.0f}s") from e
            self.last_progress = time.monotonic()
            view = view[n:]

    def send_views(self, views: list[memoryview]) -> None:
        """Send ``views`` back to back (at most ``iov_max`` of them) with few syscalls."""
        k = 0
        while k < len(views):
            try:
                n = self.sock.sendmsg(views[k:] if k else views)
            except (BlockingIOError, TimeoutError) as e:
                raise _Stalled(f"peer accepted no data for {self.cfg.io_timeout_s:.0f}s") from e
            self.last_progress = time.monotonic()
            k = _advance(views, k, n)

    # receives: SO_RCVTIMEO wakes us every _POLL_S to look at the stop flag and the stall clock
    def _wait_more(self, idle: Callable[[], bool] | None, got: int) -> None:
        if self.stop.is_set():
            raise _Closed("shutting down")
        if got == 0 and idle is not None and idle():
            return
        if time.monotonic() - self.last_progress > self.cfg.io_timeout_s:
            raise _Stalled(f"peer sent no data for {self.cfg.io_timeout_s:.0f}s")

    def recv_into(self, view: memoryview, idle: Callable[[], bool] | None = None) -> None:
        """Fill ``view``. Before its first byte, waiting never times out while ``idle()``."""
        got = 0
        if idle is None:
            self.last_progress = time.monotonic()
        while got < len(view):
            try:
                n = self.sock.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)
            except (BlockingIOError, TimeoutError):
                self._wait_more(idle, got)
                continue
            if n == 0:
                raise _Closed("peer closed the connection")
            got += n
            self.last_progress = time.monotonic()

    def recv(self, n: int, idle: Callable[[], bool] | None = None) -> bytes:
        buf = bytearray(n)
        if n:
            self.recv_into(memoryview(buf), idle)
        return bytes(buf)

    def recv_views(self, views: list[memoryview]) -> None:
        """Fill ``views`` in order (at most ``iov_max`` of them)."""
        self.last_progress = time.monotonic()
        k = 0
        while k < len(views):
            try:
                n = self.sock.recvmsg_into(views[k:] if k else views, 0, socket.MSG_WAITALL)[0]
            except (BlockingIOError, TimeoutError):
                self._wait_more(None, 1)
                continue
            if n == 0:
                raise _Closed("peer closed the connection")
            self.last_progress = time.monotonic()
            k = _advance(views, k, n)

    def drain(self, nbytes: int) -> None:
        """Receive and drop ``nbytes`` (a refused payload), keeping the stream in step."""
        scratch = memoryview(bytearray(min(nbytes, _DRAIN_CHUNK) or 1))
        while nbytes > 0:
            n = min(nbytes, len(scratch))
            self.recv_into(scratch[:n])
            nbytes -= n


def _advance(views: list[memoryview], k: int, n: int) -> int:
    """Skip ``n`` bytes moved from ``views[k:]``; trims a partly moved view in place."""
    while n and k < len(views):
        size = len(views[k])
        if n < size:
            views[k] = views[k][n:]
            return k
        n -= size
        k += 1
    while k < len(views) and len(views[k]) == 0:
        k += 1
    return k


def _span_views(
    mem: memoryview, offsets: list[int], lengths: list[int], cfg: TcpConfig
) -> Iterator[list[memoryview]]:
    """Memoryviews of ``mem`` for the spans, in lists of at most ``cfg.iov_max`` views that
    end once they hold ``cfg.batch_bytes`` (a longer span stays whole)."""
    views: list[memoryview] = []
    size, max_views, max_bytes = 0, cfg.iov_max, cfg.batch_bytes
    for o, n in zip(offsets, lengths, strict=True):
        views.append(mem[o : o + n])
        size += n
        if size >= max_bytes or len(views) >= max_views:
            yield views
            views, size = [], 0
    if views:
        yield views


def _always() -> bool:
    return True


def _pairs(spans: np.ndarray, col: int) -> bytes:
    """The wire form of spans on one side: int64 ``(offset, length)`` pairs."""
    out = np.empty((len(spans), 2), dtype="<i8")
    out[:, 0] = spans[:, col]
    out[:, 1] = spans[:, LENGTH]
    return out.tobytes()


# ------------------------------------------------------------------------------- memory
class _Memory:
    """Registered regions as memoryviews, with use counts so unregister waits for users."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._views: dict[str, memoryview] = {}
        self._uses: dict[str, int] = {}
        self._addrs: dict[str, int] = {}

    def add(self, region: Region) -> None:
        buf = (ctypes.c_uint8 * region.size).from_address(region.addr)
        with self._cond:
            self._views[region.name] = memoryview(buf).cast("B")
            self._uses[region.name] = 0
            self._addrs[region.name] = region.addr

    def address(self, name: str) -> int:
        """Base address of region ``name`` (call while holding it: :meth:`acquire`)."""
        return self._addrs[name]

    def remove(self, name: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._uses.get(name):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RegistrationError(f"region {name!r} is still being transferred")
                self._cond.wait(left)
            self._views.pop(name, None)
            self._uses.pop(name, None)
            self._addrs.pop(name, None)

    def acquire(self, name: str) -> memoryview | None:
        with self._cond:
            view = self._views.get(name)
            if view is not None:
                self._uses[name] += 1
            return view

    def release(self, name: str) -> None:
        with self._cond:
            if name in self._uses:
                self._uses[name] -= 1
                self._cond.notify_all()


def _check_spans(pairs: np.ndarray, size: int, nbytes: int | None) -> str | None:
    """Why the receiver refuses these ``(offset, length)`` pairs in a region of ``size``."""
    if len(pairs) == 0:
        return None
    offs, lens = pairs[:, 0], pairs[:, 1]
    # offs > size - lens, not offs + lens > size: the sum of two int64s from the wire can wrap
    if (lens <= 0).any() or (lens > size).any() or (offs < 0).any() or (offs > size - lens).any():
        return f"a span leaves the region of {size} bytes"
    if nbytes is not None and int(lens.sum()) != nbytes:
        return "payload size does not match the spans"
    return None


# ------------------------------------------------------------------------------- server
#: Why a peer's request for ``(offset, length)`` pairs of a region is refused (None: serve it).
GrantCheck = Callable[[str, TransferOp, str, np.ndarray], str | None]


@dataclass(frozen=True)
class _Request:
    """A request's header as the server read it; ``peer`` is the engine id named at HELLO."""

    kind: int
    xid: int
    peer: str
    name: str
    nspans: int
    nbytes: int


class _Server:
    """The data server: answers peers' WRITE, READ and NOTIFY requests."""

    def __init__(
        self,
        cfg: TcpConfig,
        engine_id: str,
        memory: _Memory,
        key: bytes | None,
        on_refused: Callable[[], None] | None,
        check_grant: GrantCheck,
    ) -> None:
        self.cfg = cfg
        self.engine_id = engine_id
        self.memory = memory
        self.key, self.on_refused = key, on_refused
        self.check_grant = check_grant
        self._refusal_log = Throttle(_REFUSAL_LOG_EVERY_S)
        self.notes: deque[Notification] = deque()
        self._stop = threading.Event()
        #: Who may hold a connection (refusals and closes are counted there).
        self.slots = ConnectionSlots(
            "tcp data server", cfg.max_connections, cfg.max_per_source, cfg.hello_timeout_s
        )
        self._threads: list[threading.Thread] = []
        self._threads_lock = threading.Lock()
        self._sock = socket.create_server((cfg.host, cfg.port))
        self.port = int(self._sock.getsockname()[1])
        self._listen(self._sock)

    def _listen(self, sock: socket.socket) -> None:
        """Serve the connections accepted on the listening ``sock`` (a thread of its own)."""
        sock.settimeout(min(_POLL_S, self.cfg.hello_timeout_s / 4))  # how often expire() runs
        t = threading.Thread(
            target=self._accept, args=(sock,), name="pdext-tcp-accept", daemon=True
        )
        with self._threads_lock:
            self._threads.append(t)
        t.start()

    def _source(self, conn: socket.socket, addr: Any) -> str:
        """Who a new connection comes from, for ``max_per_source`` (here: its IP address)."""
        return str(addr[0])

    def _accept(self, sock: socket.socket) -> None:
        """Accept loop: admit each connection to a thread of its own; close late HELLOs."""
        while not self._stop.is_set():
            self.slots.expire()
            try:
                conn, addr = sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self._stop.is_set():
                conn.close()
                return
            try:
                source = self._source(conn, addr)
            except OSError:
                conn.close()
                continue
            if not self.slots.admit(conn, source):
                conn.close()
                continue
            t = threading.Thread(
                target=self._serve, args=(conn, source), name="pdext-tcp-serve", daemon=True
            )
            with self._threads_lock:
                self._threads = [t for t in self._threads if t.is_alive()]
            try:
                t.start()
            except BaseException:
                self.slots.release(conn)
                conn.close()
                raise
            with self._threads_lock:
                self._threads.append(t)

    def _serve(self, conn: socket.socket, address: str) -> None:
        link = _Link(conn, self.cfg, self._stop)
        peer = f"? at {address}"
        session = None
        try:
            _tune(conn, self.cfg)
            peer = self._hello(link)
            session = self._session(link, peer)
            while True:
                head = link.recv(_REQ.size, idle=_always)
                kind, name_len, xid, nspans, nbytes = _REQ.unpack(head)
                if name_len > _MAX_NAME or nspans > self.cfg.max_spans:
                    raise ValueError("malformed request header")
                name = link.recv(name_len).decode()
                self._request(link, session, _Request(kind, xid, peer, name, nspans, nbytes))
        except _Closed:
            pass
        except _Refused as e:
            if self._refusal_log.ready():  # a scan floods no log
                logger.warning("tcp data connection from %s dropped: %s", peer, e)
        except (OSError, ValueError, UnicodeDecodeError) as e:
            if not self._stop.is_set():
                logger.warning("tcp data connection from %s dropped: %s", peer, e)
        finally:
            if session is not None:
                session.close()
            self.slots.release(conn)
            conn.close()

    def _session(self, link: _Link, peer: str) -> Any:
        """Per-connection state after a passed HELLO, handed to :meth:`_request` and closed
        (``close()``) with the connection (a hook for backends built on this server; here:
        none)."""
        return None

    def _request(self, link: _Link, session: Any, req: _Request) -> None:
        """Serve one request whose header and region name were read."""
        if req.kind == _NOTIFY:
            if req.nbytes > self.cfg.max_notify_bytes:
                raise ValueError(f"notification of {req.nbytes} bytes")
            payload = link.recv(req.nbytes)
            if len(self.notes) >= MAX_QUEUED_NOTIFICATIONS:
                return self._fail(link, req.xid, "too many notifications waiting")
            self.notes.append(Notification(sender=req.peer, payload=payload))
            return link.send(_RSP.pack(_OK, 0, req.xid, 0))
        pairs = np.frombuffer(link.recv(16 * req.nspans), dtype="<i8").reshape(-1, 2)
        if req.kind == _WRITE:
            self._write(link, req.xid, req.peer, req.name, pairs, req.nbytes)
        elif req.kind == _READ:
            self._read(link, req.xid, req.peer, req.name, pairs)
        else:
            raise ValueError(f"unknown request kind {req.kind}")

    def _hello(self, link: _Link) -> str:
        """Exchange HELLOs; with a key, serve only a peer that proves it holds it, and only
        within its connection's HELLO deadline (:class:`_Closed` once that has passed)."""
        magic, version, n = _HELLO.unpack(link.recv(_HELLO.size))
        if magic != _MAGIC or version != _VERSION or n > _MAX_NAME:
            raise ValueError(f"not a pdext tcp peer (magic {magic!r}, version {version})")
        peer, theirs = link.recv(n), link.recv(_NONCE)
        me, mine = self.engine_id.encode(), secrets.token_bytes(_NONCE)
        proof = _proof(self.key, "server", theirs, mine, me, peer)
        link.send(_HELLO.pack(_MAGIC, _VERSION, len(me)) + me + mine + proof)
        claimed = link.recv(_PROOF)
        expected = _proof(self.key, "client", theirs, mine, peer, me)
        if not hmac.compare_digest(claimed, expected):
            self._fail(link, 0, "refused: no proof of the fleet key (is this peer given it?)")
            if self.on_refused is not None:
                self.on_refused()
            raise _Refused("refused a peer without the fleet key")
        if not self.slots.head_done(link.sock):
            raise _Closed("closed: its HELLO came too late")
        link.send(_RSP.pack(_OK, 0, 0, 0))
        return peer.decode()

    def _fail(self, link: _Link, xid: int, message: str) -> None:
        msg = message.encode()[:_MAX_MESSAGE]
        link.send(_RSP.pack(_FAIL, len(msg), xid, 0) + msg)

    def _write(
        self, link: _Link, xid: int, peer: str, name: str, pairs: np.ndarray, nbytes: int
    ) -> None:
        view = self.memory.acquire(name)
        if view is None:
            link.drain(nbytes)
            return self._fail(link, xid, f"no region named {name!r} is registered")
        try:
            problem = _check_spans(pairs, len(view), nbytes) or self.check_grant(
                peer, TransferOp.WRITE, name, pairs
            )
            if problem:
                link.drain(nbytes)
                return self._fail(link, xid, f"region {name!r}: {problem}")
            offs, lens = pairs[:, 0].tolist(), pairs[:, 1].tolist()
            for views in _span_views(view, offs, lens, self.cfg):
                link.recv_views(views)
        finally:
            self.memory.release(name)
        link.send(_RSP.pack(_OK, 0, xid, 0))

    def _read(self, link: _Link, xid: int, peer: str, name: str, pairs: np.ndarray) -> None:
        view = self.memory.acquire(name)
        if view is None:
            return self._fail(link, xid, f"no region named {name!r} is registered")
        try:
            problem = _check_spans(pairs, len(view), None) or self.check_grant(
                peer, TransferOp.READ, name, pairs
            )
            if problem:
                return self._fail(link, xid, f"region {name!r}: {problem}")
            nbytes = int(pairs[:, 1].sum())
            link.send(_RSP.pack(_DATA, 0, xid, nbytes))
            offs, lens = pairs[:, 0].tolist(), pairs[:, 1].tolist()
            for views in _span_views(view, offs, lens, self.cfg):
                link.send_views(views)
        finally:
            self.memory.release(name)

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        self.slots.shutdown_all()
        with self._threads_lock:
            threads = list(self._threads)
        for t in threads:
            t.join(timeout=2.0)


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


# ------------------------------------------------------------------------------ client
@dataclass(eq=False)
class _Job:
    """One request on a peer connection; also the transport's ``BackendJob``."""

    kind: int
    xid: int
    local: str = ""
    remote: str = ""
    spans: np.ndarray | None = None
    payload: bytes = b""
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    finished_at: float | None = None
    _on_finish: Callable[[], None] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def finish(self, error: str | None = None) -> None:
        with self._lock:
            if self.done.is_set():
                return
            self.error = error
            self.finished_at = time.perf_counter()
            self.done.set()
            release, self._on_finish = self._on_finish, None
        if release is not None:
            release()

    def hold(self, release: Callable[[], None]) -> bool:
        """Call ``release`` when this job finishes; False (and call it now) if it has."""
        with self._lock:
            if not self.done.is_set():
                self._on_finish = release
                return True
        release()
        return False

    def state(self) -> tuple[TransferState, str | None]:
        if not self.done.is_set():
            return TransferState.PENDING, None
        return (TransferState.FAILED, self.error) if self.error else (TransferState.DONE, None)

    def wait(self, timeout: float) -> bool:
        return self.done.wait(max(0.0, timeout))


class _PeerConn:
    """One persistent connection to a peer's data server: a writer and a reader thread."""

    def __init__(
        self,
        cfg: TcpConfig,
        engine_id: str,
        desc: TransportDescriptor,
        memory: _Memory,
        key: bytes | None,
    ) -> None:
        self.cfg = cfg
        self.peer = desc.engine_id
        self.address = desc.address
        self.memory = memory
        sock = self._open(desc)
        self._stop = threading.Event()
        self.link = _Link(sock, cfg, self._stop)
        try:
            sock.settimeout(cfg.connect_timeout_s)
            _client_hello(sock, key, engine_id.encode(), desc)
            self._after_hello(sock)
        except (OSError, UnicodeDecodeError, struct.error) as e:
            sock.close()
            raise PeerUnreachable(f"tcp peer {desc.address} did not say hello: {e}") from e
        except PeerMismatch:
            sock.close()
            raise
        _tune(sock, cfg)
        self._lock = threading.Lock()
        self._pending: dict[int, _Job] = {}
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.dead: str | None = None
        self._retired = False
        self._running = 2  # the last loop to exit closes the socket
        port = desc.address.rpartition(":")[2]
        self._threads = [
            threading.Thread(target=self._write_loop, name=f"pdext-tcp-tx-{port}", daemon=True),
            threading.Thread(target=self._read_loop, name=f"pdext-tcp-rx-{port}", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _open(self, desc: TransportDescriptor) -> socket.socket:
        """A connected socket to the peer's data server (PeerUnreachable if none)."""
        host, _, port = desc.address.rpartition(":")
        try:
            return socket.create_connection((host, int(port)), timeout=self.cfg.connect_timeout_s)
        except (OSError, ValueError) as e:
            raise PeerUnreachable(f"tcp peer {desc.engine_id} at {desc.address}: {e}") from e

    def _after_hello(self, sock: socket.socket) -> None:
        """Runs once the server accepted our HELLO, before the loops start (a hook)."""

    def submit(self, job: _Job) -> _Job:
        with self._lock:
            if self.dead is None:
                if not self._pending:  # the stall clock starts now, not at the last answer
                    self.link.last_progress = time.monotonic()
                self._pending[job.xid] = job
                self._queue.put(job)
                return job
            reason = self.dead
        job.finish(f"connection to {self.peer} lost: {reason}")
        return job

    def retire(self) -> None:
        """Close once every pending request is answered (disconnect keeps handles pollable)."""
        with self._lock:
            self._retired = True
            idle = not self._pending
        if idle:
            self.close("disconnected")

    def close(self, reason: str) -> None:
        self._die(reason)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=2.0)

    def _die(self, reason: str) -> None:
        with self._lock:
            if self.dead is not None:
                return
            self.dead = reason
            jobs, self._pending = list(self._pending.values()), {}
        self._stop.set()
        self._queue.put(None)
        _shutdown(self.link.sock)
        for job in jobs:
            job.finish(f"connection to {self.peer} lost: {reason}")
        if jobs:
            logger.warning("tcp connection to %s lost: %s", self.peer, reason)

    # writer thread: requests in submission order
    def _write_loop(self) -> None:
        try:
            while True:
                job = self._queue.get()
                if job is None or self.dead is not None:
                    break
                self._send(job)
        except (OSError, ValueError) as e:
            self._die(f"{type(e).__name__}: {e}")
        finally:
            self._exit_loop()

    def _exit_loop(self) -> None:
        with self._lock:
            self._running -= 1
            last = self._running == 0
        if last:
            self.link.sock.close()

    def _send(self, job: _Job) -> None:
        link = self.link
        name = job.remote.encode()
        if job.kind == _NOTIFY:
            link.send(_REQ.pack(_NOTIFY, len(name), job.xid, 0, len(job.payload)) + job.payload)
            return
        spans = job.spans
        assert spans is not None
        nbytes = int(spans[:, LENGTH].sum())
        head = _REQ.pack(job.kind, len(name), job.xid, len(spans), nbytes) + name
        if job.kind == _READ:
            link.send(head + _pairs(spans, REMOTE))
            return
        view = self.memory.acquire(job.local)
        if view is None:  # unregistered since submit: nothing was sent, the stream is intact
            with self._lock:
                self._pending.pop(job.xid, None)
            job.finish(f"local region {job.local!r} was unregistered")
            return
        try:
            offs, lens = spans[:, LOCAL].tolist(), spans[:, LENGTH].tolist()
            first = True
            for views in _span_views(view, offs, lens, self.cfg):
                if first:  # the header rides in the payload's first sendmsg
                    views.insert(0, memoryview(head + _pairs(spans, REMOTE)))
                    first = False
                link.send_views(views)
        finally:
            self.memory.release(job.local)

    # reader thread: answers, and READ payloads into the local region
    def _read_loop(self) -> None:
        link = self.link
        try:
            while True:
                head = link.recv(_RSP.size, idle=self._idle)
                kind, msg_len, xid, nbytes = _RSP.unpack(head)
                if msg_len > _MAX_MESSAGE:
                    raise ValueError("malformed answer header")
                message = link.recv(msg_len).decode(errors="replace")
                with self._lock:
                    job = self._pending.get(xid)
                if job is None:
                    raise ValueError(f"answer for unknown transfer {xid}")
                error = None
                if kind == _DATA:
                    error = self._receive(job, nbytes)
                elif kind == _FAIL:
                    error = f"peer refused: {message}"
                elif kind != _OK:
                    raise ValueError(f"unknown answer kind {kind}")
                with self._lock:
                    self._pending.pop(xid, None)
                    close_now = self._retired and not self._pending
                job.finish(error)
                if close_now:
                    self._die("disconnected")
                    return
        except (OSError, ValueError) as e:
            self._die(f"{type(e).__name__}: {e}")
        finally:
            self._exit_loop()

    def _idle(self) -> bool:
        """Nothing is owed to us: waiting for the peer's next answer cannot stall."""
        return not self._pending

    def _receive(self, job: _Job, nbytes: int) -> str | None:
        spans = job.spans
        if job.kind != _READ or spans is None or int(spans[:, LENGTH].sum()) != nbytes:
            raise ValueError(f"unexpected DATA for transfer {job.xid}")
        view = self.memory.acquire(job.local)
        if view is None:
            self.link.drain(nbytes)
            return f"local region {job.local!r} was unregistered"
        try:
            offs, lens = spans[:, LOCAL].tolist(), spans[:, LENGTH].tolist()
            for views in _span_views(view, offs, lens, self.cfg):
                self.link.recv_views(views)
        finally:
            self.memory.release(job.local)
        return None


def _proof(
    key: bytes | None, side: str, client_nonce: bytes, server_nonce: bytes, *ids: bytes
) -> bytes:
    """One side's HELLO proof: the HMAC of both nonces and both ids (its own first) under the
    fleet key; zeros without one."""
    if key is None:
        return _NO_PROOF
    return fleet_key.tag(key, f"tcp hello {side}", client_nonce, server_nonce, *ids)


def _client_hello(
    sock: socket.socket, key: bytes | None, me: bytes, desc: TransportDescriptor
) -> None:
    """Our side of the HELLO: the peer must be ``desc``'s engine and, with a key, prove it holds
    it; then prove we do, and take the server's verdict. :class:`PeerMismatch` if not."""
    mine = secrets.token_bytes(_NONCE)
    sock.sendall(_HELLO.pack(_MAGIC, _VERSION, len(me)) + me + mine)
    magic, version, n = _HELLO.unpack(_recv_exact(sock, _HELLO.size))
    if magic != _MAGIC or version != _VERSION or n > _MAX_NAME:
        raise PeerMismatch(
            f"{desc.address} answered as {magic!r} (version {version}), expected a pdext tcp "
            f"engine (version {_VERSION})"
        )
    theirs_id = _recv_exact(sock, n)
    theirs, claimed = _recv_exact(sock, _NONCE), _recv_exact(sock, _PROOF)
    if theirs_id.decode() != desc.engine_id:
        raise PeerMismatch(
            f"{desc.address} answered as {theirs_id.decode()!r}, expected tcp engine "
            f"{desc.engine_id}"
        )
    if key is None and claimed != _NO_PROOF:
        raise PeerMismatch(
            f"tcp peer {desc.engine_id} at {desc.address} authenticates with a fleet key and "
            "this engine has none"
        )
    if not hmac.compare_digest(claimed, _proof(key, "server", mine, theirs, theirs_id, me)):
        raise PeerMismatch(
            f"tcp peer {desc.engine_id} at {desc.address} did not prove it holds the fleet key "
            "(is it given the same one?)"
        )
    sock.sendall(_proof(key, "client", mine, theirs, me, theirs_id))
    kind, msg_len, _, _ = _RSP.unpack(_recv_exact(sock, _RSP.size))
    if kind != _OK:
        reason = _recv_exact(sock, min(msg_len, _MAX_MESSAGE)).decode("utf-8", "replace")
        raise PeerMismatch(f"tcp peer {desc.engine_id} at {desc.address}: {reason}")


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed the connection")
        buf += chunk
    return bytes(buf)


# ---------------------------------------------------------------------------- transport
class TcpTransport(Transport):
    """:class:`Transport` over our own TCP data path (host memory)."""

    backend_name = "tcp"
    fleet_key_scope = "all"
    enforces_grants = True

    def __init__(
        self,
        config: TcpConfig | None = None,
        *,
        key: bytes | None = None,
        on_refused: Callable[[], None] | None = None,
        **settings: Any,
    ) -> None:
        """``key``: the fleet key peers must prove they hold (None: serve anyone);
        ``on_refused`` is called for each connection refused for want of it."""
        cfg = config or TcpConfig(**settings)
        super().__init__(coalesce_spans=cfg.coalesce)
        self.config = cfg
        self._key = key
        self._memory = _Memory()
        self._engine_id = f"{self.backend_name}-{uuid.uuid4().hex[:12]}"
        try:
            self._server = self._new_server(on_refused)
        except OSError as e:
            raise TransportError(
                f"tcp data server could not bind {cfg.host}:{cfg.port}: {e}"
            ) from e
        self._conns: dict[str, _PeerConn] = {}
        self._conns_lock = threading.Lock()
        self._xids = itertools.count(1)
        logger.info("tcp transport %s listening on %s", self._engine_id, self._local_address())

    def _new_server(self, on_refused: Callable[[], None] | None) -> _Server:
        """This transport's data server (a hook for backends built on this one)."""
        return _Server(
            self.config, self._engine_id, self._memory, self._key, on_refused, self._check_grant
        )

    def _new_conn(self, desc: TransportDescriptor) -> _PeerConn:
        """A new connection to ``desc``'s data server (a hook for backends built on this one)."""
        return _PeerConn(self.config, self._engine_id, desc, self._memory, self._key)

    @property
    def engine_id(self) -> str:
        return self._engine_id

    # memory
    def _register(self, region: Region, tensor: Any) -> None:
        if tensor is not None and getattr(tensor.device, "type", "cpu") != "cpu":
            raise RegistrationError(
                f"region {region.name!r}: the tcp backend moves host memory only "
                f"(tensor on {tensor.device})"
            )
        self._memory.add(region)

    def _unregister(self, region: Region) -> None:
        self._memory.remove(region.name, self.config.io_timeout_s)

    # peers
    def _local_address(self) -> str:
        return f"{self.config.host}:{self._server.port}"

    def _connect(self, desc: TransportDescriptor) -> None:
        with self._conns_lock:
            old = self._conns.get(desc.engine_id)
            if old is not None and old.dead is None and old.address == desc.address:
                return
        conn = self._new_conn(desc)
        with self._conns_lock:
            old = self._conns.get(desc.engine_id)
            self._conns[desc.engine_id] = conn
        if old is not None:
            old.retire()

    def _disconnect(self, desc: TransportDescriptor) -> None:
        with self._conns_lock:
            conn = self._conns.pop(desc.engine_id, None)
        if conn is not None:
            conn.retire()

    def _conn(self, desc: TransportDescriptor) -> _PeerConn:
        """The peer's connection; a lost one is replaced (PeerUnreachable if that fails)."""
        with self._conns_lock:
            conn = self._conns.get(desc.engine_id)
            if conn is None or conn.dead is not None:
                conn = self._new_conn(desc)
                self._conns[desc.engine_id] = conn
            return conn

    # transfers
    def _submit(
        self,
        op: TransferOp,
        desc: TransportDescriptor,
        local: Region,
        remote: Region,
        spans: np.ndarray,
    ) -> _Job:
        kind = _WRITE if op is TransferOp.WRITE else _READ
        job = _Job(kind, next(self._xids), local=local.name, remote=remote.name, spans=spans)
        if len(spans) > self.config.max_spans:
            job.finish(
                f"{len(spans)} spans in one transfer; the tcp backend takes {self.config.max_spans}"
            )
            return job
        try:
            conn = self._conn(desc)
        except (PeerUnreachable, PeerMismatch) as e:
            job.finish(str(e))
            return job
        return conn.submit(job)

    # notifications
    def _send_notification(self, desc: TransportDescriptor, payload: bytes, timeout: float) -> None:
        if len(payload) > self.config.max_notify_bytes:
            raise TransferError(
                f"notification of {len(payload)} bytes exceeds {self.config.max_notify_bytes}"
            )
        try:
            conn = self._conn(desc)
        except (PeerUnreachable, PeerMismatch) as e:
            raise TransferError(f"notification to {desc.engine_id}: {e}") from e
        job = conn.submit(_Job(_NOTIFY, next(self._xids), payload=payload))
        if not job.wait(timeout):
            raise TransferTimeout(
                f"notification to {desc.engine_id} not acknowledged in {timeout:.3f}s"
            )
        if job.error:
            raise TransferError(f"notification to {desc.engine_id} failed: {job.error}")

    def _receive_notifications(self) -> list[Notification]:
        notes = self._server.notes
        out = []
        while notes:
            out.append(notes.popleft())
        return out

    # close
    def _close(self) -> None:
        with self._conns_lock:
            conns, self._conns = list(self._conns.values()), {}
        for conn in conns:
            conn.close("transport closed")
        self._server.close()
