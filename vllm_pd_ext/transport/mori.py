"""AMD MoRI-IO backend (``mori.io.IOEngine``): RDMA, XGMI or TCP, for ROCm hosts.

NOT YET RUN ON ROCm HARDWARE: ``amd-mori`` needs ROCm libraries and ships a Python 3.10
wheel only. This module is written against MoRI-IO's documented Python API (ROCm/mori
``docs/MORI-IO-GUIDE.md``, ``python/mori/io/engine.py``) and tested through a fake engine that
enforces that API's contract (``tests/unit/transport/fake_mori.py``). The module is
injectable (``MoriTransport(module=...)``) for exactly that reason.

How the API is used:

* ``IOEngine(key, IOEngineConfig(host, port))`` then ``create_backend(BackendType.X, cfg)``;
* regions: ``register_torch_tensor(tensor)`` for tensors; ``register_memory(ptr, size,
  device_id, loc)`` for host buffers (older wheels without it: a uint8 tensor view);
  each returns a ``MemoryDesc`` whose ``pack()`` bytes travel in our descriptor;
* peers: ``EngineDesc.unpack`` + ``register_remote_engine``;
* transfers go through sessions (``create_session(local_md, remote_md)``, cached per region
  pair) with ``batch_write`` / ``batch_read(local_offsets, remote_offsets, sizes, uid)``; the
  returned ``TransferStatus`` is polled (``InProgress`` / ``Succeeded`` / ``Failed``,
  ``Code``, ``Message``). A post refused with "SQ full" (send queue back-pressure) is retried
  with backoff for up to ``sq_full_retry_s``;
* what a finished handle means (the WRITE mode's decode reuses its blocks once told): MoRI
  marks a status ``Succeeded`` once every work request of its batch completed (RDMA: the
  signalled CQEs of a reliable connection, i.e. the peer acknowledged the bytes; XGMI: the
  copy's HIP event), so a write reported done has landed. A transfer of several chunks is
  reported failed only once every chunk's status is final (:class:`_StatusJob`). Within one
  status MoRI reports the first failed CQE at once: with ``qp_per_transfer`` > 1 work
  requests of that batch on other queue pairs may still land after it (with one queue pair
  those after the failure are flushed). Hence ``qp_per_transfer`` 1 (the default) where a
  failed WRITE must not be followed by late bytes (checked against ROCm/mori's
  ``src/io/rdma/backend_impl.cpp``, ``xgmi/backend_impl.cpp``; its TCP backend not);
* MoRI's own notification path is off (``enable_notification=False``, as vLLM does: with it on,
  a post failure under load can poison a status); messages go over
  :mod:`vllm_pd_ext.transport.notify` instead.
"""

from __future__ import annotations

import base64
import ctypes
import importlib
import logging
import time
import uuid
from collections.abc import Callable
from types import ModuleType
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from vllm_pd_ext.transport.base import (
    Notification,
    Region,
    TransferOp,
    TransferState,
    Transport,
    TransportDescriptor,
    poll_until_done,
)
from vllm_pd_ext.transport.errors import (
    PeerMismatch,
    RegistrationError,
    TransferError,
    TransportError,
)
from vllm_pd_ext.transport.notify import NotifyLimits, NotifyServer, send_notification
from vllm_pd_ext.transport.spans import LENGTH, LOCAL, REMOTE

logger = logging.getLogger(__name__)

_ENGINE_KEY = "engine_desc"
_MEM_PREFIX = "mem:"
_NOTIFY_KEY = "notify"


class MoriConfig(BaseModel):
    """Settings of the ``mori`` backend (``get_backend("mori", **settings)``)."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="IP the engine binds and advertises.")
    port: int = Field(0, ge=0, le=65535, description="Engine port; 0 picks a free one.")
    backend: Literal["rdma", "xgmi", "tcp"] = "rdma"
    engine_key: str | None = Field(None, description="Unique engine key; default: random.")
    qp_per_transfer: int = Field(1, ge=1)
    post_batch_size: int = Field(-1, description="WRs per post; -1 = MoRI's choice.")
    num_worker_threads: int = Field(1, ge=1)
    max_batch_entries: int = Field(4096, ge=1, description="Spans per batch_* call.")
    sq_full_retry_s: float = Field(1.0, ge=0, description="Retry 'SQ full' posts this long.")
    notify_port: int = Field(0, ge=0, le=65535, description="Notification port; 0 = free.")
    notify_limits: NotifyLimits = Field(
        default_factory=NotifyLimits,
        description="What the notification server serves at most: connections (in all and "
        "per address), a frame's deadline, payload and sender sizes; e.g. "
        "{'max_per_source': 8}.",
    )
    coalesce: bool = Field(True, description="Merge spans adjacent on both sides.")


def _b64(raw: bytes) -> str:
    return base64.b64encode(bytes(raw)).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"), validate=True)


class _StatusJob:
    """The MoRI statuses of one transfer (one per posted chunk). It is pending while any
    chunk is, failed if one failed: a chunk's failure does not stop the others, so it is
    reported only once none of them can land anything more."""

    def __init__(self, statuses: list[Any]) -> None:
        self.statuses = statuses

    def state(self) -> tuple[TransferState, str | None]:
        failure = None
        for st in self.statuses:
            if st.Failed():
                failure = failure or f"{st.Message()} (code={st.Code()})"
            elif not st.Succeeded():
                return TransferState.PENDING, None
        return (TransferState.DONE, None) if failure is None else (TransferState.FAILED, failure)

    def wait(self, timeout: float) -> bool:
        return poll_until_done(self, timeout)


class MoriTransport(Transport):
    """:class:`Transport` over MoRI-IO sessions."""

    backend_name = "mori"
    fleet_key_scope = "notifications"
    #: Peers read and write our memory one-sided over RDMA: nothing of ours sees the request.
    enforces_grants = False

    def __init__(
        self,
        config: MoriConfig | None = None,
        *,
        module: ModuleType | Any | None = None,
        key: bytes | None = None,
        on_refused: Callable[[], None] | None = None,
        **settings: Any,
    ) -> None:
        """``key``: the fleet key notifications must be tagged with (None: none are);
        ``on_refused`` is called for each notification refused for want of it."""
        cfg = config or MoriConfig(**settings)
        super().__init__(coalesce_spans=cfg.coalesce)
        self.config = cfg
        if module is None:
            try:
                module = importlib.import_module("mori.io")
            except ImportError as e:
                raise TransportError(
                    "the mori backend needs AMD MoRI-IO (`amd-mori`, ROCm hosts only)"
                ) from e
        self._mori = module
        self._key = cfg.engine_key or f"pdext-{uuid.uuid4().hex[:12]}"
        self._engine = module.IOEngine(self._key, module.IOEngineConfig(cfg.host, cfg.port))
        try:
            backend_args = self._backend_args(cfg)
        except AttributeError as e:
            raise TransportError(f"this MoRI-IO build has no {cfg.backend} backend: {e}") from e
        self._engine.create_backend(*backend_args)
        self._mem: dict[str, Any] = {}  # region name -> local MemoryDesc
        self._remote_mem: dict[tuple[str, str], Any] = {}  # (peer, region) -> MemoryDesc
        self._remote_engines: dict[str, Any] = {}  # peer -> EngineDesc
        self._sessions: dict[tuple[str, str, str], Any] = {}  # (peer, local, remote)
        self._fleet_key = key
        self._notify = NotifyServer(
            cfg.host, cfg.notify_port, key=key, on_refused=on_refused, limits=cfg.notify_limits
        )
        logger.info("MoRI-IO engine %s up (%s)", self._key, cfg.backend)

    def _backend_args(self, cfg: MoriConfig) -> tuple[Any, Any]:
        m = self._mori
        if cfg.backend == "xgmi":
            return m.BackendType.XGMI, m.XgmiBackendConfig()
        if cfg.backend == "tcp":
            return m.BackendType.TCP, m.TcpBackendConfig()
        return m.BackendType.RDMA, m.RdmaBackendConfig(
            qp_per_transfer=cfg.qp_per_transfer,
            post_batch_size=cfg.post_batch_size,
            num_worker_threads=cfg.num_worker_threads,
            enable_notification=False,
        )

    @property
    def engine_id(self) -> str:
        return self._key

    # memory
    def _register(self, region: Region, tensor: Any) -> None:
        try:
            if tensor is not None:
                md = self._engine.register_torch_tensor(tensor)
            elif hasattr(self._engine, "register_memory"):
                md = self._engine.register_memory(
                    region.addr, region.size, -1, self._mori.MemoryLocationType.CPU
                )
            else:  # older wheels: only tensors can be registered
                import torch

                buf = (ctypes.c_uint8 * region.size).from_address(region.addr)
                view = torch.from_numpy(np.ctypeslib.as_array(buf))
                md = self._engine.register_torch_tensor(view)
        except Exception as e:
            raise RegistrationError(f"MoRI-IO could not register {region.name}: {e}") from e
        if md is None:
            raise RegistrationError(f"MoRI-IO returned no memory descriptor for {region.name}")
        self._mem[region.name] = md

    def _unregister(self, region: Region) -> None:
        md = self._mem.pop(region.name)
        for key in [k for k in self._sessions if k[1] == region.name]:
            del self._sessions[key]
        self._engine.deregister_memory(md)

    # peers
    def _local_address(self) -> str:
        desc = self._engine.get_engine_desc()
        port = getattr(desc, "port", None) or self.config.port
        return f"{self.config.host}:{port}"

    def _descriptor_extra(self) -> dict[str, str]:
        extra = {
            _ENGINE_KEY: _b64(self._engine.get_engine_desc().pack()),
            _NOTIFY_KEY: self._notify.address,
        }
        for name, md in self._mem.items():
            extra[_MEM_PREFIX + name] = _b64(md.pack())
        return extra

    def _connect(self, desc: TransportDescriptor) -> None:
        m = self._mori
        try:
            engine_desc = m.EngineDesc.unpack(_unb64(desc.extra[_ENGINE_KEY]))
            mems = {
                r.name: m.MemoryDesc.unpack(_unb64(desc.extra[_MEM_PREFIX + r.name]))
                for r in desc.regions
            }
            if _NOTIFY_KEY not in desc.extra:
                raise KeyError(_NOTIFY_KEY)
        except (KeyError, ValueError) as e:
            raise PeerMismatch(f"MoRI descriptor of {desc.engine_id} lacks {e}") from e
        if getattr(engine_desc, "key", desc.engine_id) != desc.engine_id:
            raise PeerMismatch(f"engine key {engine_desc.key!r} != {desc.engine_id!r}")
        with self._lock:  # the peer maps that transfers read (a connect runs without it)
            if desc.engine_id in self._remote_engines:
                self._drop_peer(desc.engine_id)
            self._engine.register_remote_engine(engine_desc)
            self._remote_engines[desc.engine_id] = engine_desc
            for name, md in mems.items():
                self._remote_mem[(desc.engine_id, name)] = md

    def _drop_peer(self, peer: str) -> None:
        for key in [k for k in self._sessions if k[0] == peer]:
            del self._sessions[key]
        for mem_key in [k for k in self._remote_mem if k[0] == peer]:
            del self._remote_mem[mem_key]
        engine_desc = self._remote_engines.pop(peer, None)
        if engine_desc is not None:
            self._engine.deregister_remote_engine(engine_desc)

    def _disconnect(self, desc: TransportDescriptor) -> None:
        self._drop_peer(desc.engine_id)

    def _session(self, peer: str, local: Region, remote: Region) -> Any:
        key = (peer, local.name, remote.name)
        with self._lock:
            sess = self._sessions.get(key)
            if sess is None:
                sess = self._engine.create_session(
                    self._mem[local.name], self._remote_mem[(peer, remote.name)]
                )
                if sess is None:
                    raise TransferError(
                        f"MoRI-IO could not create a session {local.name} -> {peer}/{remote.name}"
                    )
                self._sessions[key] = sess
            return sess

    # transfers
    def _submit(
        self,
        op: TransferOp,
        desc: TransportDescriptor,
        local: Region,
        remote: Region,
        spans: np.ndarray,
    ) -> _StatusJob:
        sess = self._session(desc.engine_id, local, remote)
        post = sess.batch_write if op is TransferOp.WRITE else sess.batch_read
        step = self.config.max_batch_entries
        statuses = []
        for i in range(0, len(spans), step):
            chunk = spans[i : i + step]
            args = (
                chunk[:, LOCAL].tolist(),
                chunk[:, REMOTE].tolist(),
                chunk[:, LENGTH].tolist(),
            )
            statuses.append(self._post(sess, post, args))
        return _StatusJob(statuses)

    def _post(self, sess: Any, post: Any, args: tuple[list[int], list[int], list[int]]) -> Any:
        """Post one batch; re-post while MoRI answers 'SQ full' (bounded)."""
        deadline = time.monotonic() + self.config.sq_full_retry_s
        delay = 1e-3
        while True:
            status = post(*args, sess.allocate_transfer_uid())
            if not (status.Failed() and "SQ full" in (status.Message() or "")):
                return status
            if time.monotonic() >= deadline:
                return status
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    # notifications
    def _send_notification(self, desc: TransportDescriptor, payload: bytes, timeout: float) -> None:
        send_notification(
            desc.extra[_NOTIFY_KEY],
            self._key,
            payload,
            timeout,
            self._fleet_key,
            max_payload_bytes=self.config.notify_limits.max_payload_bytes,
        )

    def _receive_notifications(self) -> list[Notification]:
        return self._notify.drain()

    # close
    def _close(self) -> None:
        self._notify.close()
        self._sessions.clear()
        for peer in list(self._remote_engines):
            try:
                self._drop_peer(peer)
            except Exception:  # pragma: no cover - best effort during close
                logger.debug("deregister_remote_engine(%s) failed during close", peer)
        for md in self._mem.values():
            try:
                self._engine.deregister_memory(md)
            except Exception:  # pragma: no cover - best effort during close
                logger.debug("deregister_memory failed during close")
        self._mem.clear()
        close = getattr(self._engine, "close", None)
        if callable(close):
            close()
        self._engine = None
