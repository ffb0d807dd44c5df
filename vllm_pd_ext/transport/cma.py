"""Same-host KV data path by cross-memory attach: the ``cma`` backend.

When prefill and decode share a host, a socket copies every byte twice (user -> kernel ->
user). ``process_vm_readv`` / ``process_vm_writev`` copy once, straight between the two
processes' registered regions (what UCX's shared-memory path does). This backend is the
``tcp`` backend (:mod:`vllm_pd_ext.transport.tcp`) with one change: between two transports
on the same host only the *payload* moves by CMA. Connections, HELLO with its fleet-key
proofs, region bounds, grants and notifications are tcp's, unchanged.

How:

* the data server listens on its TCP port as tcp does and also on a Unix socket in a private
  directory (mode 0700: only this user, or root, can connect). The descriptor carries the
  socket's path and this host's identity (boot id and pid namespace). The directory goes
  when the server closes; one that a killed process left is removed by the next data server
  made beside it, once it is a minute old and nobody listens on its socket;
* a client whose host identity matches connects over the Unix socket, says tcp's HELLO, then
  offers CMA: its pid, and the address of a 16-byte probe holding a random token. The server
  takes the requester's pid from the kernel (``SO_PEERCRED``), never from the offer: an offer
  whose pid is not the kernel's, a requester running as another user, or a probe the server
  cannot read (``EPERM`` from ptrace rules: Yama, containers, a non-dumpable process) makes
  it answer FAIL with the reason, and that connection carries payloads over the socket as tcp
  does. The client logs the reason and counts it (:meth:`CmaTransport.paths`); a peer on
  another host, or one whose socket cannot be reached, is counted and logged the same way and
  served over TCP. Decided once per connection;
* on a CMA connection a READ or WRITE is a request frame with both sides' spans and the
  requester's region base and size; no payload follows. The server checks its own spans
  against its region (bounds and grants exactly as tcp), the requester's against the size it
  declared (a requester lying about its own addresses can only hurt its own process: the
  server copies into or out of the kernel-named pid, nothing else), then copies: a READ with
  ``process_vm_writev`` into the requester, a WRITE with ``process_vm_readv`` from it, at most
  ``cma_iov_max`` spans (IOV_MAX is 1024) per call, and answers OK, or FAIL with the errno.
  64, 256 and 1024 spans a call moved scattered 16 KiB and 896 KiB spans within the noise of
  each other in an interleaved A/B run on a loaded 2-core host; 1024 makes the fewest calls.
  Before each copy it checks that the requester's process is still the one that connected (a
  pidfd taken at the offer), so a connection handed to another process cannot aim the copy at
  a recycled pid;
* the requester holds its region from sending the frame until the answer (so ``unregister``
  waits for it, as for tcp's payloads).

Trust: CMA needs what ptrace needs (the same user, and no Yama or container rule against it),
so a server able to copy into a requester could already write anywhere in it without this
backend; the checks above keep a requester (even a fleet-key holder) from steering the copy
into any other process, and out of the server's regions' granted spans.

Host memory only, as tcp. GPU memory would take CUDA IPC handles at the same seam (the offer
and the request frame), which this module does not implement.

Wire (little-endian, after tcp's HELLO and verdict, on Unix-socket connections only): the
client's offer ``i64 pid, u64 probe address, 16-byte token`` (pid 0: not offered); the
server's answer frame, OK or FAIL with the reason. A CMA request is tcp's request header with
kind 4 (READ) or 5 (WRITE) and zero payload bytes, the server's region name, ``u64 base,
u64 size`` of the requester's region, and int64 ``(server offset, requester offset, length)``
triples.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import secrets
import select
import shutil
import socket
import struct
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
from pydantic import Field

from vllm_pd_ext.transport.base import TransferOp, TransportDescriptor
from vllm_pd_ext.transport.errors import TransportError
from vllm_pd_ext.transport.spans import LENGTH, LOCAL, REMOTE
from vllm_pd_ext.transport.tcp import (
    _MAX_MESSAGE,
    _OK,
    _READ,
    _REQ,
    _RSP,
    _WRITE,
    TcpConfig,
    TcpTransport,
    _check_spans,
    _Job,
    _Link,
    _PeerConn,
    _recv_exact,
    _Request,
    _Server,
)
from vllm_pd_ext.util.throttle import Throttle

logger = logging.getLogger(__name__)

_CMA_READ, _CMA_WRITE = 4, 5
_OFFER = struct.Struct("<qQ16s")  # pid, probe address, probe token
_REGION = struct.Struct("<QQ")  # requester's region base, size
_UCRED = struct.Struct("3i")  # pid, uid, gid
_TOKEN = 16
IOV_MAX = 1024
_LOG_EVERY_S = 10.0
_DIR_PREFIX = "pdext-cma-"
#: A socket directory of ours this old that nobody listens on was left by a dead process.
_STALE_AFTER_S = 60.0
#: Descriptor keys of this backend.
SOCKET_KEY, HOST_KEY = "cma_socket", "cma_host"


class CmaConfig(TcpConfig):
    """Settings of the ``cma`` backend: tcp's, plus where CMA applies."""

    cma: bool = Field(
        True,
        description="Offer cross-memory attach to same-host peers (False: tcp over a "
        "Unix socket for them, counted as a fallback).",
    )
    cma_iov_max: int = Field(
        IOV_MAX, ge=1, le=IOV_MAX, description="Spans per process_vm_readv/writev call."
    )
    socket_dir: str | None = Field(
        None,
        description="Where the private directory of the Unix socket is made (None: the "
        "system's temporary directory).",
    )


# ------------------------------------------------------------------------ the system calls
@cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    for fn in (libc.process_vm_readv, libc.process_vm_writev):
        fn.argtypes = [
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_ulong,
            ctypes.c_void_p,
            ctypes.c_ulong,
            ctypes.c_ulong,
        ]
        fn.restype = ctypes.c_ssize_t
    return libc


def host_identity() -> str:
    """This host and pid namespace: peers with the same identity can attach to each other."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"


def _iovecs(base: int, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``struct iovec`` array (base + offset, length) for the spans, as uint64 pairs."""
    out = np.empty((len(offsets), 2), dtype=np.uint64)
    out[:, 0] = offsets.astype(np.uint64) + np.uint64(base)
    out[:, 1] = lengths
    return out


def copy(pid: int, write: bool, mine: np.ndarray, theirs: np.ndarray, per_call: int) -> None:
    """Copy between our iovecs ``mine`` and process ``pid``'s iovecs ``theirs`` (same lengths
    pairwise): ``write`` into theirs (``process_vm_writev``), else from theirs. At most
    ``per_call`` iovecs a call. ``OSError`` on failure or a short copy."""
    fn = _libc().process_vm_writev if write else _libc().process_vm_readv
    for start in range(0, len(mine), per_call):
        a, b = mine[start : start + per_call], theirs[start : start + per_call]
        want = int(a[:, 1].sum())
        got = fn(pid, a.ctypes.data, len(a), b.ctypes.data, len(b), 0)
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        if got != want:  # a fault part-way: the kernel stops at an iovec boundary
            raise OSError(errno.EFAULT, f"copied {got} of {want} bytes")


# --------------------------------------------------------------------------------- frames
def offer_frame(pid: int, probe_addr: int, token: bytes) -> bytes:
    """The client's CMA offer (pid 0: not offered)."""
    return _OFFER.pack(pid, probe_addr, token)


def request_frame(
    kind: int, xid: int, name: str, base: int, size: int, triples: np.ndarray
) -> bytes:
    """A CMA READ or WRITE: ``triples`` are ``(server offset, requester offset, length)``."""
    raw = name.encode()
    body = np.ascontiguousarray(triples, dtype="<i8").tobytes()
    return _REQ.pack(kind, len(raw), xid, len(triples), 0) + raw + _REGION.pack(base, size) + body


# ------------------------------------------------------------------------- socket folders
def sweep_socket_dirs(parent: str) -> int:
    """Remove the socket directories under ``parent`` that processes killed before closing
    their transport left: ours (same owner), older than ``_STALE_AFTER_S``, and nobody
    listening on their socket. Returns how many."""
    removed, now = 0, time.time()
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return 0
    for entry in entries:
        if not entry.name.startswith(_DIR_PREFIX):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not entry.is_dir(follow_symlinks=False) or st.st_uid != os.geteuid():
            continue
        if now - st.st_mtime < _STALE_AFTER_S or _listened(os.path.join(entry.path, "data")):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed += 1
    return removed


def _listened(path: str) -> bool:
    """Whether a server listens on the Unix socket ``path`` (when unsure: yes)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:
        return True
    finally:
        probe.close()
    return True


# --------------------------------------------------------------------------------- server
@dataclass
class _Session:
    """What the server knows of the requester on one Unix-socket connection."""

    pid: int
    uid: int
    pidfd: int | None = None
    cma: bool = False

    def alive(self) -> bool:
        """The process that connected has not exited (its pid cannot have been recycled)."""
        if self.pidfd is None:
            return False
        p = select.poll()
        p.register(self.pidfd, select.POLLIN)
        return not p.poll(0)

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


class _CmaServer(_Server):
    """tcp's data server, plus a Unix socket on which requesters may move payloads by CMA."""

    def __init__(self, *args: Any, socket_dir: str | None, per_call: int, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.per_call = per_call
        self._log = Throttle(_LOG_EVERY_S)
        parent = socket_dir or tempfile.gettempdir()
        swept = sweep_socket_dirs(parent)
        if swept:
            logger.info("cma: removed %d socket directories left by dead processes", swept)
        self.dir = tempfile.mkdtemp(prefix=_DIR_PREFIX, dir=parent)  # mode 0700
        self.path = os.path.join(self.dir, "data")
        self._unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._unix.bind(self.path)
            self._unix.listen(128)
        except OSError:
            self._unix.close()
            shutil.rmtree(self.dir, ignore_errors=True)
            super().close()
            raise
        self._listen(self._unix)

    def _source(self, conn: socket.socket, addr: Any) -> str:
        if conn.family != socket.AF_UNIX:
            return super()._source(conn, addr)
        pid, _, _ = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        return f"pid {pid}"

    def _session(self, link: _Link, peer: str) -> _Session | None:
        sock = link.sock
        if sock.family != socket.AF_UNIX:
            return None
        pid, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        session = _Session(pid, uid)
        declared, probe, token = _OFFER.unpack(link.recv(_OFFER.size))
        problem = self._refusal(session, declared, probe, token)
        if problem is None:
            session.cma = True
            link.send(_RSP.pack(_OK, 0, 0, 0))
        else:
            session.close()
            if self._log.ready():
                logger.warning(
                    "cma: peer %s (pid %d) moves payloads over the socket: %s", peer, pid, problem
                )
            self._fail(link, 0, problem)
        return session

    def _refusal(self, session: _Session, declared: int, probe: int, token: bytes) -> str | None:
        """Why the requester cannot be served by CMA (None: it can)."""
        if declared == 0:
            return "the peer did not offer cross-memory attach"
        if declared != session.pid:
            return (
                f"the peer says it is pid {declared}, the kernel says {session.pid} "
                "(another pid namespace?)"
            )
        if session.uid != os.geteuid():
            return f"the peer runs as uid {session.uid}, this engine as {os.geteuid()}"
        try:
            session.pidfd = os.pidfd_open(session.pid)
        except OSError as e:
            return f"pidfd_open: {e}"
        got = ctypes.create_string_buffer(_TOKEN)
        mine = np.array([[ctypes.addressof(got), _TOKEN]], dtype=np.uint64)
        theirs = np.array([[probe, _TOKEN]], dtype=np.uint64)
        try:
            copy(session.pid, False, mine, theirs, 1)
        except OSError as e:
            return f"process_vm_readv of the peer failed: {e}"
        if got.raw != token:
            return "the probe read back another token"
        return None

    def _request(self, link: _Link, session: Any, req: _Request) -> None:
        if req.kind not in (_CMA_READ, _CMA_WRITE):
            return super()._request(link, session, req)
        base, size = _REGION.unpack(link.recv(_REGION.size))
        triples = np.frombuffer(link.recv(24 * req.nspans), dtype="<i8").reshape(-1, 3)
        if not isinstance(session, _Session) or not session.cma:
            return self._fail(
                link, req.xid, "cross-memory attach was not agreed on this connection"
            )
        op = TransferOp.READ if req.kind == _CMA_READ else TransferOp.WRITE
        view = self.memory.acquire(req.name)
        if view is None:
            return self._fail(link, req.xid, f"no region named {req.name!r} is registered")
        try:
            ours = np.ascontiguousarray(triples[:, [0, 2]])
            problem = (
                _check_spans(ours, len(view), None)
                or _requester_problem(triples, base, size)
                or self.check_grant(req.peer, op, req.name, ours)
            )
            if problem:
                return self._fail(link, req.xid, f"region {req.name!r}: {problem}")
            if not session.alive():
                return self._fail(link, req.xid, "the requester's process has exited")
            mine = _iovecs(self.memory.address(req.name), triples[:, 0], triples[:, 2])
            other = _iovecs(base, triples[:, 1], triples[:, 2])
            try:
                copy(session.pid, op is TransferOp.READ, mine, other, self.per_call)
            except OSError as e:
                return self._fail(
                    link, req.xid, f"region {req.name!r}: cross-memory {op.value} failed: {e}"
                )
        finally:
            self.memory.release(req.name)
        link.send(_RSP.pack(_OK, 0, req.xid, 0))

    def close(self) -> None:
        super().close()
        self._unix.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _requester_problem(triples: np.ndarray, base: int, size: int) -> str | None:
    """Why the requester's side of the spans is refused: outside the region it declared."""
    if base + size >= 1 << 64:
        return "the requester's region wraps around the address space"
    problem = _check_spans(triples[:, [1, 2]], size, None)
    return f"the requester's side: {problem}" if problem else None


# --------------------------------------------------------------------------------- client
class _CmaPeerConn(_PeerConn):
    """tcp's peer connection; over a Unix socket, with payloads moved by the server's CMA."""

    def __init__(self, *args: Any, count: Callable[[str, str | None], None], **kw: Any) -> None:
        self.cma = False
        self._closing = False
        self._sent: set[int] = set()  # CMA requests sent and not yet answered
        self._count = count
        self._fallback: str | None = None
        self._probe = ctypes.create_string_buffer(secrets.token_bytes(_TOKEN), _TOKEN)
        super().__init__(*args, **kw)
        self._count(self.peer, None if self.cma else self._fallback)

    def _open(self, desc: TransportDescriptor) -> socket.socket:
        path, host = desc.extra.get(SOCKET_KEY), desc.extra.get(HOST_KEY)
        if not path or host != host_identity():
            self._fallback = "peer on another host"
            return super()._open(desc)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.cfg.connect_timeout_s)
        try:
            sock.connect(path)
        except OSError as e:
            sock.close()
            self._fallback = f"its Unix socket cannot be reached ({e})"
            return super()._open(desc)
        return sock

    def _after_hello(self, sock: socket.socket) -> None:
        if sock.family != socket.AF_UNIX:
            return
        offered = isinstance(self.cfg, CmaConfig) and self.cfg.cma
        pid = os.getpid() if offered else 0
        sock.sendall(offer_frame(pid, ctypes.addressof(self._probe), self._probe.raw))
        kind, msg_len, _, _ = _RSP.unpack(_recv_exact(sock, _RSP.size))
        if msg_len > _MAX_MESSAGE:
            raise ValueError("malformed answer to the CMA offer")
        reason = _recv_exact(sock, msg_len).decode("utf-8", "replace")
        self.cma = kind == _OK
        if not self.cma:
            self._fallback = f"the peer refused cross-memory attach: {reason}"

    def _send(self, job: _Job) -> None:
        if not self.cma or job.kind not in (_READ, _WRITE):
            return super()._send(job)
        spans = job.spans
        assert spans is not None
        view = self.memory.acquire(job.local)
        if view is None:  # unregistered since submit: nothing was sent
            with self._lock:
                self._pending.pop(job.xid, None)
            job.finish(f"local region {job.local!r} was unregistered")
            return
        with self._lock:
            closing = self._closing
            if not closing:
                self._sent.add(job.xid)
        if closing:
            self.memory.release(job.local)
            with self._lock:
                self._pending.pop(job.xid, None)
            job.finish("the connection is closing")
            return

        def release() -> None:
            with self._lock:
                self._sent.discard(job.xid)
            self.memory.release(job.local)

        # held until the answer: the server copies into or out of it until then
        if not job.hold(release):
            return
        triples = np.stack([spans[:, REMOTE], spans[:, LOCAL], spans[:, LENGTH]], axis=1)
        kind = _CMA_READ if job.kind == _READ else _CMA_WRITE
        base = self.memory.address(job.local)
        self.link.send(request_frame(kind, job.xid, job.remote, base, len(view), triples))

    def close(self, reason: str) -> None:
        """As tcp's, but first wait (up to ``io_timeout_s``) for the answers to the CMA
        requests already sent: until its answer the server may still copy into or out of our
        region, which the caller may free once the transport is closed."""
        deadline = time.monotonic() + self.cfg.io_timeout_s
        with self._lock:
            self._closing = True
            sent = [job for xid, job in self._pending.items() if xid in self._sent]
        for job in sent:
            job.wait(deadline - time.monotonic())
        if any(not job.done.is_set() for job in sent):
            logger.error(
                "cma: closing the connection to %s with %d transfers unanswered: the peer may "
                "still copy into or out of their regions",
                self.peer,
                len(sent),
            )
        super().close(reason)


# ------------------------------------------------------------------------------ transport
class CmaTransport(TcpTransport):
    """:class:`Transport` over tcp's data path, moving payloads by cross-memory attach
    between processes on the same host (host memory)."""

    backend_name = "cma"
    reports_fallbacks = True

    def __init__(
        self,
        config: CmaConfig | None = None,
        *,
        key: bytes | None = None,
        on_refused: Callable[[], None] | None = None,
        on_fallback: Callable[[], None] | None = None,
        **settings: Any,
    ) -> None:
        """As :class:`TcpTransport`, with :class:`CmaConfig` settings; ``on_fallback`` is
        called for each connection whose payloads go over the socket (also logged, and
        counted in :meth:`paths`)."""
        cfg = config or CmaConfig(**settings)
        self._on_fallback = on_fallback
        self._paths: Counter[str] = Counter()
        self._paths_lock = threading.Lock()
        self._fallback_log = Throttle(_LOG_EVERY_S)
        try:
            self._host = host_identity()
        except OSError as e:
            raise TransportError(f"cma: this host's identity cannot be read: {e}") from e
        super().__init__(cfg, key=key, on_refused=on_refused)

    def _new_server(self, on_refused: Callable[[], None] | None) -> _Server:
        cfg = self.config
        assert isinstance(cfg, CmaConfig)
        return _CmaServer(
            cfg,
            self._engine_id,
            self._memory,
            self._key,
            on_refused,
            self._check_grant,
            socket_dir=cfg.socket_dir,
            per_call=cfg.cma_iov_max,
        )

    def _new_conn(self, desc: TransportDescriptor) -> _PeerConn:
        return _CmaPeerConn(
            self.config, self._engine_id, desc, self._memory, self._key, count=self._counted
        )

    def _descriptor_extra(self) -> dict[str, str]:
        server = self._server
        assert isinstance(server, _CmaServer)
        return {SOCKET_KEY: server.path, HOST_KEY: self._host}

    def _counted(self, peer: str, fallback: str | None) -> None:
        with self._paths_lock:
            self._paths["socket" if fallback else "cma"] += 1
            n = self._paths["socket"]
        if not fallback:
            logger.info("cma: payloads to %s by cross-memory attach", peer)
            return
        if self._on_fallback is not None:
            self._on_fallback()
        if self._fallback_log.ready():
            logger.warning(
                "cma: payloads to %s go over the socket, not cross-memory attach: %s "
                "(%d such connections so far)",
                peer,
                fallback,
                n,
            )

    def paths(self) -> dict[str, int]:
        """Connections made so far by how they move payloads: ``cma`` or ``socket``
        (a fallback, each logged with its reason)."""
        with self._paths_lock:
            return {"cma": self._paths["cma"], "socket": self._paths["socket"]}
