"""A fake ``mori.io`` module that enforces MoRI-IO's documented Python contract.

Test-only: injected with ``MoriTransport(module=fake_mori)``. It mirrors the names and call
shapes of ROCm/mori's ``python/mori/io`` (IOEngine, IOEngineSession, EngineDesc, MemoryDesc,
TransferStatus, the backend configs and enums) and moves real bytes between processes over a
small TCP data plane, so the transport contract tests can run the ``mori`` backend across two
processes. What it enforces, as the real engine does or documents:

* a backend must be created before memory is registered or sessions are made;
* ``create_session`` returns ``None`` unless the local MemoryDesc is registered on this engine
  and the remote one belongs to a registered remote engine;
* transfers go through sessions (engine-level read/write raise here, to keep us on sessions);
* every (offset, size) is checked against the registered sizes: out of range gives a status
  that is ``Failed()`` with ``StatusCode.ERR_INVALID_ARGS`` at once, nothing moves;
* a transfer uid may be used once per engine;
* statuses start ``IN_PROGRESS`` and finish later, on the engine's worker thread; callers
  must poll (``InProgress`` / ``Succeeded`` / ``Failed``) or ``Wait()``;
* deregistered memory kills its sessions (``ERR_BAD_STATE``).

Knobs for tests: ``engine.sq_full_budget`` (the next N posts fail with "SQ full"),
``engine.posts`` (the entry counts of every post), ``engine.gate`` (clear it to hold every
accepted transfer ``IN_PROGRESS`` until it is set again).
"""

from __future__ import annotations

import ctypes
import enum
import itertools
import json
import queue
import socket
import struct
import threading
from dataclasses import asdict, dataclass
from typing import Any

_LEN = struct.Struct("!I")


class BackendType(enum.Enum):
    Unknown = 0
    XGMI = 1
    RDMA = 2
    TCP = 3


class MemoryLocationType(enum.Enum):
    Unknown = 0
    CPU = 1
    GPU = 2


class StatusCode(enum.Enum):
    SUCCESS = 0
    INIT = 1
    IN_PROGRESS = 2
    ERR_INVALID_ARGS = 3
    ERR_NOT_FOUND = 4
    ERR_RDMA_OP = 5
    ERR_BAD_STATE = 6
    ERR_GPU_OP = 7


class PollCqMode(enum.Enum):
    POLLING = 0
    EVENT = 1


@dataclass
class IOEngineConfig:
    host: str = "127.0.0.1"
    port: int = 0


@dataclass
class RdmaBackendConfig:
    qp_per_transfer: int = 1
    post_batch_size: int = -1
    num_worker_threads: int = 1
    poll_cq_mode: PollCqMode = PollCqMode.POLLING
    enable_notification: bool = True


@dataclass
class XgmiBackendConfig:
    num_streams: int = 64
    num_events: int = 64


@dataclass
class TcpBackendConfig:
    pass


@dataclass(frozen=True)
class EngineDesc:
    key: str
    host: str
    port: int

    def pack(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @staticmethod
    def unpack(raw: bytes) -> EngineDesc:
        return EngineDesc(**json.loads(raw))


@dataclass(frozen=True)
class MemoryDesc:
    engine_key: str
    id: int
    data: int
    size: int
    device_id: int
    loc: MemoryLocationType

    def pack(self) -> bytes:
        d = asdict(self)
        d["loc"] = self.loc.name
        return json.dumps(d).encode()

    @staticmethod
    def unpack(raw: bytes) -> MemoryDesc:
        d = json.loads(raw)
        d["loc"] = MemoryLocationType[d["loc"]]
        return MemoryDesc(**d)


class TransferStatus:
    """Polled by the caller; set by the engine's worker thread."""

    def __init__(self) -> None:
        self._code = StatusCode.INIT
        self._msg = ""
        self._done = threading.Event()

    def _set(self, code: StatusCode, msg: str = "") -> None:
        self._code, self._msg = code, msg
        if code not in (StatusCode.INIT, StatusCode.IN_PROGRESS):
            self._done.set()

    def Code(self) -> StatusCode:
        return self._code

    def Message(self) -> str:
        return self._msg

    def Init(self) -> bool:
        return self._code is StatusCode.INIT

    def InProgress(self) -> bool:
        return self._code in (StatusCode.INIT, StatusCode.IN_PROGRESS)

    def Succeeded(self) -> bool:
        return self._code is StatusCode.SUCCESS

    def Failed(self) -> bool:
        return self._code not in (StatusCode.INIT, StatusCode.IN_PROGRESS, StatusCode.SUCCESS)

    def Wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("connection closed")
        got += k
    return bytes(buf)


def _send_msg(sock: socket.socket, header: dict, payload: bytes = b"") -> None:
    raw = json.dumps(header).encode()
    sock.sendall(_LEN.pack(len(raw)) + raw + payload)


def _recv_msg(sock: socket.socket) -> dict:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    return json.loads(_recv_exact(sock, n))


def _in_bounds(offsets: list[int], sizes: list[int], size: int) -> bool:
    return all(o >= 0 and n > 0 and o + n <= size for o, n in zip(offsets, sizes, strict=True))


class IOEngineSession:
    """A pre-established (local MemoryDesc, remote MemoryDesc) pair."""

    def __init__(self, engine: IOEngine, local: MemoryDesc, remote: MemoryDesc) -> None:
        self._engine = engine
        self._local = local
        self._remote = remote

    def allocate_transfer_uid(self) -> int:
        return self._engine.allocate_transfer_uid()

    def alive(self) -> bool:
        return self._local.id in self._engine._mems and not self._engine._closed

    def read(self, local_offset: int, remote_offset: int, size: int, uid: int) -> TransferStatus:
        return self.batch_read([local_offset], [remote_offset], [size], uid)

    def write(self, local_offset: int, remote_offset: int, size: int, uid: int) -> TransferStatus:
        return self.batch_write([local_offset], [remote_offset], [size], uid)

    def batch_read(self, local_offsets, remote_offsets, sizes, uid) -> TransferStatus:
        return self._engine._post("read", self, list(local_offsets), list(remote_offsets),
                                  list(sizes), uid)  # fmt: skip

    def batch_write(self, local_offsets, remote_offsets, sizes, uid) -> TransferStatus:
        return self._engine._post("write", self, list(local_offsets), list(remote_offsets),
                                  list(sizes), uid)  # fmt: skip


class IOEngine:
    """One engine: registered memory, known remote engines, a TCP data plane, a worker."""

    def __init__(self, key: str, config: IOEngineConfig) -> None:
        self.key = key
        self._backends: dict[BackendType, Any] = {}
        self._mems: dict[int, MemoryDesc] = {}
        self._remotes: dict[str, EngineDesc] = {}
        self._uids = itertools.count(1)
        self._used_uids: set[int] = set()
        self._inbound: dict[tuple[str, int], TransferStatus] = {}
        self._ids = itertools.count(1)
        self._closed = False
        self._lock = threading.Lock()
        self.sq_full_budget = 0
        self.posts: list[int] = []
        self.gate = threading.Event()
        self.gate.set()
        self._server = socket.create_server((config.host, config.port))
        self._host = config.host
        self._port = self._server.getsockname()[1]
        self._jobs: queue.Queue = queue.Queue()
        self._conns: dict[str, socket.socket] = {}
        threading.Thread(target=self._accept_loop, daemon=True, name=f"fake-mori-{key}").start()
        threading.Thread(target=self._work_loop, daemon=True, name=f"fake-mori-w-{key}").start()

    # ----------------------------------------------------------- control plane
    def get_engine_desc(self) -> EngineDesc:
        return EngineDesc(self.key, self._host, self._port)

    def create_backend(self, type: BackendType, config: Any = None) -> None:
        expected = {
            BackendType.RDMA: RdmaBackendConfig,
            BackendType.XGMI: XgmiBackendConfig,
            BackendType.TCP: TcpBackendConfig,
        }
        if type not in expected or not isinstance(config, expected[type] | None):
            raise RuntimeError(f"fake mori: bad backend {type} / {config!r}")
        self._backends[type] = config

    def remove_backend(self, type: BackendType) -> None:
        self._backends.pop(type, None)

    def register_remote_engine(self, desc: EngineDesc) -> None:
        if not isinstance(desc, EngineDesc):
            raise TypeError("register_remote_engine takes an EngineDesc")
        self._remotes[desc.key] = desc

    def deregister_remote_engine(self, desc: EngineDesc) -> None:
        self._remotes.pop(desc.key, None)
        conn = self._conns.pop(desc.key, None)
        if conn is not None:
            conn.close()

    def register_memory(
        self, ptr: int, size: int, device_id: int, mem_loc: MemoryLocationType
    ) -> MemoryDesc:
        if not self._backends:
            raise RuntimeError("fake mori: create a backend before registering memory")
        if ptr <= 0 or size <= 0:
            raise RuntimeError("fake mori: bad memory range")
        md = MemoryDesc(self.key, next(self._ids), int(ptr), int(size), device_id, mem_loc)
        self._mems[md.id] = md
        return md

    def register_torch_tensor(self, tensor: Any) -> MemoryDesc:
        if not tensor.is_contiguous():
            raise RuntimeError("input tensor must be contiguous")
        loc = MemoryLocationType.CPU if tensor.device.type == "cpu" else MemoryLocationType.GPU
        return self.register_memory(
            tensor.data_ptr(), tensor.numel() * tensor.element_size(), -1, loc
        )

    def deregister_memory(self, md: MemoryDesc) -> None:
        self._mems.pop(md.id, None)

    def allocate_transfer_uid(self) -> int:
        return next(self._uids)

    def create_session(self, local: MemoryDesc, remote: MemoryDesc) -> IOEngineSession | None:
        if not self._backends:
            return None
        if local.engine_key != self.key or local.id not in self._mems:
            return None
        if remote.engine_key not in self._remotes:
            return None
        return IOEngineSession(self, local, remote)

    def read(self, *args: Any) -> TransferStatus:
        raise NotImplementedError("fake mori: use sessions (create_session)")

    write = batch_read = batch_write = read

    def pop_inbound_transfer_status(self, remote_key: str, uid: int) -> TransferStatus | None:
        return self._inbound.pop((remote_key, uid), None)

    def close(self) -> None:
        self._closed = True
        self._jobs.put(None)
        self._server.close()
        for conn in self._conns.values():
            conn.close()

    # ------------------------------------------------------------- data plane
    def _post(self, op, sess, local_offsets, remote_offsets, sizes, uid) -> TransferStatus:
        status = TransferStatus()
        self.posts.append(len(sizes))
        if self.sq_full_budget > 0:
            self.sq_full_budget -= 1
            status._set(StatusCode.ERR_RDMA_OP, "ibv_post_send: SQ full")
            return status
        if not (len(local_offsets) == len(remote_offsets) == len(sizes)) or not sizes:
            status._set(StatusCode.ERR_INVALID_ARGS, "offsets and sizes differ in length")
            return status
        with self._lock:
            if uid in self._used_uids:
                status._set(StatusCode.ERR_INVALID_ARGS, f"transfer uid {uid} reused")
                return status
            self._used_uids.add(uid)
        if not sess.alive():
            status._set(StatusCode.ERR_BAD_STATE, "session's local memory was deregistered")
            return status
        if not _in_bounds(local_offsets, sizes, sess._local.size) or not _in_bounds(
            remote_offsets, sizes, sess._remote.size
        ):
            status._set(StatusCode.ERR_INVALID_ARGS, "offset + size out of registered range")
            return status
        status._set(StatusCode.IN_PROGRESS)
        self._jobs.put((op, sess, local_offsets, remote_offsets, sizes, uid, status))
        return status

    def _work_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            op, sess, lo, ro, sizes, uid, status = job
            while not self.gate.wait(0.05):
                if self._closed:
                    status._set(StatusCode.ERR_BAD_STATE, "engine closed")
                    break
            if self._closed:
                continue
            try:
                self._run(op, sess, lo, ro, sizes, uid, status)
            except Exception as e:  # any failure must end the status, never leave it pending
                self._conns.pop(sess._remote.engine_key, None)
                status._set(StatusCode.ERR_BAD_STATE, f"peer connection failed: {e}")

    def _conn(self, key: str) -> socket.socket:
        conn = self._conns.get(key)
        if conn is None:
            remote = self._remotes[key]
            conn = socket.create_connection((remote.host, remote.port), timeout=30)
            self._conns[key] = conn
        return conn

    def _run(self, op, sess, lo, ro, sizes, uid, status) -> None:
        conn = self._conn(sess._remote.engine_key)
        header = {"op": op, "src": self.key, "mem": sess._remote.id, "offsets": ro,
                  "sizes": sizes, "uid": uid}  # fmt: skip
        base = sess._local.data
        if op == "write":
            payload = b"".join(
                ctypes.string_at(base + o, n) for o, n in zip(lo, sizes, strict=True)
            )
            _send_msg(conn, header, payload)
            reply = _recv_msg(conn)
        else:
            _send_msg(conn, header)
            reply = _recv_msg(conn)
            if reply["code"] == StatusCode.SUCCESS.name:
                data = _recv_exact(conn, sum(sizes))
                pos = 0
                for o, n in zip(lo, sizes, strict=True):
                    ctypes.memmove(base + o, data[pos : pos + n], n)
                    pos += n
        status._set(StatusCode[reply["code"]], reply.get("msg", ""))

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    req = _recv_msg(conn)
                except (OSError, ConnectionError, ValueError):
                    return
                md = self._mems.get(req["mem"])
                offsets, sizes = req["offsets"], req["sizes"]
                payload = _recv_exact(conn, sum(sizes)) if req["op"] == "write" else b""
                inbound = TransferStatus()
                if md is None:
                    code, msg = StatusCode.ERR_NOT_FOUND, "memory not registered"
                elif not _in_bounds(offsets, sizes, md.size):
                    code, msg = StatusCode.ERR_INVALID_ARGS, "out of registered range"
                else:
                    code, msg = StatusCode.SUCCESS, ""
                if md is not None and code is StatusCode.SUCCESS and req["op"] == "write":
                    pos = 0
                    for o, n in zip(offsets, sizes, strict=True):
                        ctypes.memmove(md.data + o, payload[pos : pos + n], n)
                        pos += n
                inbound._set(code, msg)
                self._inbound[(req["src"], req["uid"])] = inbound
                _send_msg(conn, {"code": code.name, "msg": msg})
                if md is not None and code is StatusCode.SUCCESS and req["op"] == "read":
                    conn.sendall(
                        b"".join(
                            ctypes.string_at(md.data + o, n)
                            for o, n in zip(offsets, sizes, strict=True)
                        )
                    )
