"""The transport interface: move KV bytes between two processes' registered memory.

One :class:`Transport` lives in each process that sends or receives KV bytes (a vLLM worker,
or a benchmark process). Its life:

1. ``register_buffer(name, addr, size)`` / ``register_tensor(name, tensor)``: make memory
   reachable by the engine. Regions are named (e.g. one per KV-cache layer).
2. ``descriptor()``: a small, serialisable :class:`TransportDescriptor` (engine id, address,
   regions) that the connector sends to the peer over its side channel (ZMQ, HTTP).
3. ``connect(peer_descriptor)`` returns the peer id used in every later call.
4. ``write(peer, local_region, remote_region, spans)`` / ``read(...)`` submit one batched
   transfer of many ``(local offset, remote offset, length)`` spans and return a
   :class:`TransferHandle` at once; ``poll`` / ``wait(timeout)`` finish it.
5. ``notify(peer, payload)`` sends a small message that arrives after every transfer submitted
   to that peer before it; the peer reads it with ``drain_notifications()``.
6. ``close()`` releases the engine and every registration.

A connector can confine what peers may do to its memory: after ``enforce_grants()`` a peer's
read or write is served only inside spans ``grant(grant_id, op, peer, spans)`` gave that peer
for that operation, until ``revoke(grant_id)``. Only backends whose own code serves peers
(``enforces_grants``: ``tcp``) can check this; for the others a grant is a no-op and their data
plane must be isolated (see docs/security.md). Without ``enforce_grants()`` a transport serves
any span of any registered region to any peer its backend lets in.

:class:`Transport` implements validation (spans are checked against the registered bounds
BEFORE anything reaches the engine), coalescing of adjacent spans, handle bookkeeping and
instrumentation (:class:`~vllm_pd_ext.transport.stats.TransferStats`) once for all backends.
Backends implement the ``_``-prefixed hooks only.
"""

from __future__ import annotations

import abc
import base64
import itertools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np

from vllm_pd_ext.transport.errors import (
    GrantError,
    PeerMismatch,
    RegistrationError,
    TransferError,
    TransferTimeout,
    TransportClosed,
    TransportError,
    UnknownPeer,
    UnknownRegion,
)
from vllm_pd_ext.transport.grants import GrantTable, merge_extents
from vllm_pd_ext.transport.spans import LOCAL, REMOTE, as_span_array, check_bounds, coalesce
from vllm_pd_ext.transport.stats import TransferStats
from vllm_pd_ext.util.throttle import Throttle

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

#: Version of the descriptor wire format; bumped on incompatible changes.
DESCRIPTOR_VERSION = 1
#: Notifications a transport keeps until they are drained; more are refused (the sender gets
#: an error), so a peer that floods them cannot fill memory.
MAX_QUEUED_NOTIFICATIONS = 16384
#: Grants a transport holds at once (one per transfer in flight); more are refused.
MAX_GRANTS = 4096
#: Requests refused for want of a grant are logged at most this often (all are counted).
_UNGRANTED_LOG_EVERY_S = 10.0


class TransferOp(str, Enum):
    """Direction of a transfer, seen from the process that submits it."""

    WRITE = "write"  # local region -> remote region
    READ = "read"  # remote region -> local region


class TransferState(str, Enum):
    """State of a submitted transfer."""

    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class Region:
    """A registered memory region: ``size`` bytes at ``addr`` in its owner's address space."""

    name: str
    addr: int
    size: int


@dataclass(frozen=True)
class TransportDescriptor:
    """What a peer needs to reach this transport: exchanged once over a side channel.

    ``engine_id`` is unique per transport and is the peer id ``connect`` returns; ``address``
    is where its engine listens; ``extra`` holds backend-specific strings (packed engine and
    memory descriptors).
    """

    backend: str
    engine_id: str
    address: str
    regions: tuple[Region, ...] = ()
    extra: Mapping[str, str] = field(default_factory=dict)

    def region(self, name: str) -> Region:
        """The peer's region called ``name``; :class:`PeerMismatch` if it has none."""
        for r in self.regions:
            if r.name == name:
                return r
        raise PeerMismatch(f"peer {self.engine_id} registered no region named {name!r}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (stable field names; ``v`` is the format version)."""
        return {
            "v": DESCRIPTOR_VERSION,
            "backend": self.backend,
            "engine_id": self.engine_id,
            "address": self.address,
            "regions": [[r.name, r.addr, r.size] for r in self.regions],
            "extra": dict(self.extra),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TransportDescriptor:
        """Inverse of :meth:`to_dict`; :class:`PeerMismatch` on another version or bad data."""
        if data.get("v") != DESCRIPTOR_VERSION:
            raise PeerMismatch(
                f"descriptor version {data.get('v')!r}, expected {DESCRIPTOR_VERSION}"
            )
        try:
            return cls(
                backend=str(data["backend"]),
                engine_id=str(data["engine_id"]),
                address=str(data["address"]),
                regions=tuple(Region(str(n), int(a), int(s)) for n, a, s in data["regions"]),
                extra={str(k): str(v) for k, v in data.get("extra", {}).items()},
            )
        except (KeyError, TypeError, ValueError) as e:
            raise PeerMismatch(f"malformed transport descriptor: {e}") from e

    def to_bytes(self) -> bytes:
        """Compact JSON bytes for a side channel."""
        return json.dumps(self.to_dict(), separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> TransportDescriptor:
        """Inverse of :meth:`to_bytes`."""
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise PeerMismatch(f"transport descriptor is not JSON: {e}") from e
        if not isinstance(data, dict):
            raise PeerMismatch("transport descriptor is not a JSON object")
        return cls.from_dict(data)


@dataclass(frozen=True)
class Notification:
    """A message a peer sent with ``notify``: ``sender`` is its engine id."""

    sender: str
    payload: bytes


def encode_payload(payload: bytes) -> str:
    """Payload bytes as ASCII, for engines whose notification carries text only."""
    return base64.b64encode(payload).decode("ascii")


def decode_payload(text: str) -> bytes:
    """Inverse of :func:`encode_payload`; ``ValueError`` on bad input."""
    return base64.b64decode(text.encode("ascii"), validate=True)


class BackendJob(Protocol):
    """What a backend returns for one submitted transfer."""

    def state(self) -> tuple[TransferState, str | None]:
        """Current state and, when failed, the engine's message. Never blocks."""
        ...

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds; True once the job is no longer pending."""
        ...


def poll_until_done(job: BackendJob, timeout: float) -> bool:
    """``BackendJob.wait`` for jobs that can only be polled: poll with a capped backoff."""
    deadline = time.monotonic() + max(0.0, timeout)
    delay = 50e-6
    while True:
        if job.state()[0] is not TransferState.PENDING:
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, 2e-3)


class TransferHandle:
    """One submitted batched transfer. Finish it with ``poll()`` or ``wait(timeout)``.

    Stats count a transfer when its final state is first observed, so every handle should be
    polled or waited until it is not pending.
    """

    def __init__(
        self,
        *,
        transport: Transport,
        handle_id: int,
        op: TransferOp,
        peer: str,
        nbytes: int,
        spans: int,
        posted_spans: int,
        job: BackendJob | None,
        submitted_at: float,
    ) -> None:
        self.id = handle_id
        self.op = op
        self.peer = peer
        self.nbytes = nbytes
        self.spans = spans
        self.posted_spans = posted_spans
        self.submitted_at = submitted_at
        self.seconds: float | None = None
        self.error: str | None = None
        self._transport = transport
        self._job = job
        self._state = TransferState.DONE if job is None else TransferState.PENDING
        if job is None:
            self.seconds = 0.0

    @property
    def state(self) -> TransferState:
        """Last observed state (call ``poll`` to refresh)."""
        return self._state

    def poll(self) -> TransferState:
        """Refresh and return the state; never blocks. See :meth:`Transport.poll`."""
        return self._transport.poll(self)

    def wait(self, timeout: float) -> None:
        """Block until done; see :meth:`Transport.wait`."""
        self._transport.wait(self, timeout)

    def __repr__(self) -> str:
        return (
            f"TransferHandle(id={self.id}, op={self.op.value}, peer={self.peer!r}, "
            f"bytes={self.nbytes}, spans={self.spans}, state={self._state.value})"
        )


class Transport(abc.ABC):
    """Moves bytes between registered regions of this process and of connected peers.

    Thread-safe: a connector may submit from one thread and poll from another. All methods
    run in the calling process; the engine may use its own threads.
    """

    #: Name under which the backend is registered (``get_backend(name)``).
    backend_name: ClassVar[str] = ""
    #: What the backend authenticates with a fleet key (the ``key=`` and ``on_refused=``
    #: settings, taken only when this is not empty): ``"all"``, every connection (no read,
    #: write or notification from a peer without the key); ``"notifications"``, only those
    #: (the engine it drives moves bytes unauthenticated); ``""``, nothing.
    fleet_key_scope: ClassVar[str] = ""
    #: Whether the backend serves peers' reads and writes only inside granted spans once
    #: :meth:`enforce_grants` is on. False where an engine we only drive serves them
    #: (one-sided RDMA, a third-party engine): there :meth:`grant` and :meth:`revoke` are
    #: no-ops and the data plane must be isolated instead.
    enforces_grants: ClassVar[bool] = False
    #: Whether the backend has a fast path it may not get with a peer (then it moves that
    #: peer's payloads a slower way and logs why). Such a backend takes ``on_fallback=``, a
    #: callable called once per connection that falls back.
    reports_fallbacks: ClassVar[bool] = False

    def __init__(self, *, coalesce_spans: bool = True) -> None:
        self.stats = TransferStats()
        self._coalesce = coalesce_spans
        self._lock = threading.RLock()
        #: Serializes what changes the backend's peers (connect, disconnect, close): a connect
        #: does network I/O, so it holds this, never ``_lock`` (which every engine step takes,
        #: to drain notifications and poll transfers).
        self._peers_lock = threading.Lock()
        self._regions: dict[str, Region] = {}
        self._keepalive: dict[str, Any] = {}
        self._peers: dict[str, TransportDescriptor] = {}
        self._outstanding: dict[str, set[TransferHandle]] = {}
        self._ids = itertools.count(1)
        self._closed = False
        self._grants = GrantTable(MAX_GRANTS)
        self._grants_enforced = False
        self._on_ungranted: Callable[[], None] | None = None
        self._ungranted_log = Throttle(_UNGRANTED_LOG_EVERY_S)

    # ------------------------------------------------------------------ memory
    def register_buffer(self, name: str, addr: int, size: int, *, owner: Any = None) -> Region:
        """Register ``size`` bytes of host memory at ``addr`` under ``name``.

        The caller keeps the memory alive and unmoved until ``unregister``/``close``; pass
        ``owner`` (e.g. the numpy array) to have the transport hold a reference to it.
        Raises :class:`RegistrationError` on a duplicate name, bad bounds or engine refusal.
        """
        if addr <= 0 or size <= 0:
            raise RegistrationError(f"region {name!r}: bad address {addr:#x} or size {size}")
        return self._add_region(Region(name, int(addr), int(size)), owner, tensor=None)

    def register_tensor(self, name: str, tensor: torch.Tensor) -> Region:
        """Register a contiguous tensor's storage under ``name`` (CPU here; GPU on GPU hosts).

        The transport keeps a reference to the tensor until it is unregistered.
        Raises :class:`RegistrationError` for a non-contiguous or empty tensor.
        """
        if not tensor.is_contiguous():
            raise RegistrationError(f"region {name!r}: tensor must be contiguous")
        size = tensor.numel() * tensor.element_size()
        if size == 0:
            raise RegistrationError(f"region {name!r}: tensor is empty")
        region = Region(name, int(tensor.data_ptr()), int(size))
        return self._add_region(region, tensor, tensor=tensor)

    def _add_region(self, region: Region, owner: Any, *, tensor: Any) -> Region:
        with self._lock:
            self._check_open()
            if region.name in self._regions:
                raise RegistrationError(f"a region named {region.name!r} is already registered")
            self._register(region, tensor)
            self._regions[region.name] = region
            if owner is not None:
                self._keepalive[region.name] = owner
        logger.debug("registered region %s: %d bytes at %#x", region.name, region.size, region.addr)
        return region

    def unregister(self, name: str) -> None:
        """Unregister the region ``name``; later transfers naming it fail with UnknownRegion."""
        with self._lock:
            self._check_open()
            region = self._local_region(name)
            self._unregister(region)
            del self._regions[name]
            self._keepalive.pop(name, None)

    @property
    def regions(self) -> dict[str, Region]:
        """A copy of the registered local regions by name."""
        with self._lock:
            return dict(self._regions)

    # ------------------------------------------------------------------ grants
    def enforce_grants(self, on_refused: Callable[[], None] | None = None) -> None:
        """From now on serve a peer's read or write only inside spans granted to that peer
        for that operation (:meth:`grant`); anything else is refused (the peer's transfer
        fails), counted in ``stats`` and passed to ``on_refused``, and logged at most every
        10 s. Cannot be turned off. A no-op where ``enforces_grants`` is False."""
        with self._lock:
            self._on_ungranted = on_refused
            self._grants_enforced = True

    @property
    def grants_enforced(self) -> bool:
        """True once :meth:`enforce_grants` was called on a backend that enforces grants."""
        return self._grants_enforced and self.enforces_grants

    def grant(self, grant_id: str, op: TransferOp, peer: str, spans: Mapping[str, Any]) -> None:
        """Let ``peer`` (its engine id) ``op`` (READ: read from us; WRITE: write into us) the
        ``spans`` of our regions: ``{region name: (offset, length) pairs}``. A grant with the
        same id is replaced. Raises :class:`GrantError` for a span outside its region, an
        unregistered region, or when ``MAX_GRANTS`` are held. A no-op where
        ``enforces_grants`` is False."""
        if not self.enforces_grants:
            return
        with self._lock:
            self._check_open()
            sizes = {name: r.size for name, r in self._regions.items()}
        extents = {}
        for name, pairs in spans.items():
            if name not in sizes:
                raise GrantError(f"grant {grant_id!r}: no local region named {name!r}")
            extents[name] = merge_extents(pairs, sizes[name])
        self._grants.add(grant_id, TransferOp(op).value, peer, extents)

    def revoke(self, grant_id: str) -> bool:
        """Withdraw grant ``grant_id`` (requests checked after this are refused); False if it
        was not held. Idempotent; a no-op where ``enforces_grants`` is False."""
        return self._grants.remove(grant_id)

    def _check_grant(self, peer: str, op: TransferOp, region: str, pairs: np.ndarray) -> str | None:
        """For backends that serve peers: why ``peer``'s ``op`` of ``(offset, length)``
        ``pairs`` (inside ``region``'s bounds) is refused, or None to serve it. Counts and
        logs (rate-limited) each refusal."""
        if not self._grants_enforced or self._grants.allows(peer, op.value, region, pairs):
            return None
        self.stats.record_ungranted()
        if self._on_ungranted is not None:
            self._on_ungranted()
        if self._ungranted_log.ready():  # a peer that keeps asking floods no log
            logger.warning(
                "refused a %s of region %r by peer %s: outside what was granted to it "
                "(%d refused so far)",
                op.value,
                region,
                peer,
                self.stats.totals().ungranted,
            )
        return f"{op.value} outside the spans granted to {peer}"

    # ------------------------------------------------------------------- peers
    @property
    @abc.abstractmethod
    def engine_id(self) -> str:
        """Unique id of this transport's engine (the peer id others get from ``connect``)."""

    def descriptor(self) -> TransportDescriptor:
        """This transport's descriptor, with every region registered so far."""
        with self._lock:
            self._check_open()
            return TransportDescriptor(
                backend=self.backend_name,
                engine_id=self.engine_id,
                address=self._local_address(),
                regions=tuple(self._regions.values()),
                extra=self._descriptor_extra(),
            )

    def connect(self, peer: TransportDescriptor | bytes) -> str:
        """Make a peer reachable from its descriptor; return its peer id (its engine id).

        Connecting again with a newer descriptor of the same engine (more regions) replaces
        the old one. Raises :class:`PeerMismatch` for another backend and
        :class:`PeerUnreachable` when the backend checks reachability and the peer is down.
        """
        desc = TransportDescriptor.from_bytes(peer) if isinstance(peer, bytes) else peer
        if desc.backend != self.backend_name:
            raise PeerMismatch(
                f"peer {desc.engine_id} uses backend {desc.backend!r}, this transport "
                f"uses {self.backend_name!r}"
            )
        if desc.engine_id == self.engine_id:
            raise PeerMismatch("a transport cannot connect to itself")
        with self._peers_lock:
            self._check_open()
            self._connect(desc)  # may wait on the peer: not under ``_lock``
            with self._lock:
                self._peers[desc.engine_id] = desc
                self._outstanding.setdefault(desc.engine_id, set())
        logger.info(
            "connected to %s peer %s at %s", self.backend_name, desc.engine_id, desc.address
        )
        return desc.engine_id

    def disconnect(self, peer: str) -> None:
        """Forget a peer; its pending handles can still be polled."""
        with self._peers_lock, self._lock:
            self._check_open()
            desc = self._peer(peer)
            self._disconnect(desc)
            del self._peers[peer]

    def peers(self) -> list[str]:
        """Ids of the connected peers."""
        with self._lock:
            return list(self._peers)

    # --------------------------------------------------------------- transfers
    def write(self, peer: str, local_region: str, remote_region: str, spans: Any) -> TransferHandle:
        """Submit a batched write of ``spans`` from ``local_region`` into the peer's region.

        ``spans`` is an ``(n, 3)`` int array or iterable of ``(local offset, remote offset,
        length)``. Every span is checked against both regions' registered sizes, and spans
        overlapping in the destination are refused, before anything is submitted
        (:class:`RegionBoundsError`). Returns at once; zero spans give a finished handle.
        """
        return self._transfer(TransferOp.WRITE, peer, local_region, remote_region, spans)

    def read(self, peer: str, local_region: str, remote_region: str, spans: Any) -> TransferHandle:
        """Submit a batched read of ``spans`` from the peer's region into ``local_region``.

        Same span rules as :meth:`write`; the destination is the local region.
        """
        return self._transfer(TransferOp.READ, peer, local_region, remote_region, spans)

    def _transfer(
        self, op: TransferOp, peer: str, local_name: str, remote_name: str, spans: Any
    ) -> TransferHandle:
        arr = as_span_array(spans)
        with self._lock:
            self._check_open()
            desc = self._peer(peer)
            local = self._local_region(local_name)
            remote = desc.region(remote_name)
        target = REMOTE if op is TransferOp.WRITE else LOCAL
        check_bounds(arr, local.size, remote.size, target=target)
        posted = coalesce(arr) if self._coalesce else arr
        nbytes = int(arr[:, 2].sum()) if len(arr) else 0
        submitted_at = time.perf_counter()  # before the engine can finish it
        job = self._submit(op, desc, local, remote, posted) if len(arr) else None
        handle = TransferHandle(
            transport=self,
            handle_id=next(self._ids),
            op=op,
            peer=peer,
            nbytes=nbytes,
            spans=len(arr),
            posted_spans=len(posted),
            job=job,
            submitted_at=submitted_at,
        )
        if job is not None:
            with self._lock:
                self._outstanding.setdefault(peer, set()).add(handle)
        return handle

    def poll(self, handle: TransferHandle) -> TransferState:
        """Refresh ``handle``'s state without blocking and return it.

        The first time a final state is seen, the transfer is counted in ``stats``. A failed
        transfer's engine message is in ``handle.error``. Works after ``disconnect``.
        """
        if handle._state is not TransferState.PENDING:
            return handle._state
        self._check_open()
        assert handle._job is not None
        state, message = handle._job.state()
        if state is not TransferState.PENDING:
            self._finish(handle, state, message)
        return handle._state

    def wait(self, handle: TransferHandle, timeout: float) -> None:
        """Block until ``handle`` finishes, at most ``timeout`` seconds.

        Raises :class:`TransferError` if it failed and :class:`TransferTimeout` if it is still
        pending at the deadline (it may still finish: poll or wait again).
        """
        if self.poll(handle) is TransferState.PENDING:
            assert handle._job is not None
            handle._job.wait(timeout)
            if self.poll(handle) is TransferState.PENDING:
                self.stats.record_timeout()
                raise TransferTimeout(
                    f"{handle.op.value} of {handle.nbytes} bytes to {handle.peer} still pending "
                    f"after {timeout:.3f}s"
                )
        if handle._state is TransferState.FAILED:
            raise TransferError(
                f"{handle.op.value} of {handle.nbytes} bytes ({handle.spans} spans) with peer "
                f"{handle.peer} failed: {handle.error}"
            )

    def wait_all(self, handles: Iterable[TransferHandle], timeout: float) -> None:
        """Wait for every handle within one overall ``timeout``; raise on the first failure."""
        deadline = time.monotonic() + timeout
        for h in handles:
            self.wait(h, max(0.0, deadline - time.monotonic()))

    def _finish(self, handle: TransferHandle, state: TransferState, message: str | None) -> None:
        with self._lock:
            if handle._state is not TransferState.PENDING:
                return
            finished = getattr(handle._job, "finished_at", None) or time.perf_counter()
            handle.seconds = max(0.0, finished - handle.submitted_at)
            handle._state = state
            handle.error = message if state is TransferState.FAILED else None
            self._outstanding.get(handle.peer, set()).discard(handle)
        ok = state is TransferState.DONE
        self.stats.record_transfer(
            nbytes=handle.nbytes,
            spans=handle.spans,
            posted_spans=handle.posted_spans,
            seconds=handle.seconds,
            ok=ok,
        )
        if not ok:
            logger.warning("transfer %r failed: %s", handle, message)

    # ------------------------------------------------------------ notification
    def notify(self, peer: str, payload: bytes, timeout: float = 10.0) -> None:
        """Send a small message (a few KB at most) to ``peer``.

        It is sent only after every transfer this transport submitted to ``peer`` before the
        call has finished (success or failure), so a peer that receives "request X done" can
        trust X's bytes. Raises :class:`TransferTimeout` if those transfers or the send do not
        finish within ``timeout``, and :class:`TransferError` if the send fails.
        """
        deadline = time.monotonic() + timeout
        with self._lock:
            self._check_open()
            desc = self._peer(peer)
            pending = list(self._outstanding.get(peer, ()))
        for h in pending:
            try:
                self.wait(h, max(0.0, deadline - time.monotonic()))
            except TransferTimeout:
                raise
            except TransferError:
                pass  # a failed transfer is finished: it cannot land after the notice
        self._send_notification(desc, bytes(payload), max(0.0, deadline - time.monotonic()))
        self.stats.record_notification(sent=1)

    def drain_notifications(self) -> list[Notification]:
        """Return the notifications received since the last call (oldest first); never blocks."""
        with self._lock:
            self._check_open()
        notes = self._receive_notifications()
        if notes:
            self.stats.record_notification(received=len(notes))
        return notes

    # -------------------------------------------------------------------- close
    def close(self) -> None:
        """Release the engine and all registrations; idempotent.

        Pending handles are abandoned: polling them afterwards raises TransportClosed.
        """
        with self._peers_lock, self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._close()
            finally:
                self._regions.clear()
                self._keepalive.clear()
                self._peers.clear()
                self._outstanding.clear()
                self._grants.clear()
        logger.debug("closed %s transport %s", self.backend_name, self.engine_id)

    @property
    def closed(self) -> bool:
        """True once ``close`` was called."""
        return self._closed

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- helpers
    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed(f"{self.backend_name} transport is closed")

    def _peer(self, peer: str) -> TransportDescriptor:
        try:
            return self._peers[peer]
        except KeyError:
            raise UnknownPeer(f"no connected peer {peer!r}") from None

    def _local_region(self, name: str) -> Region:
        try:
            return self._regions[name]
        except KeyError:
            raise UnknownRegion(f"no local region named {name!r}") from None

    # ------------------------------------------------------------ backend hooks
    @abc.abstractmethod
    def _register(self, region: Region, tensor: Any) -> None:
        """Register ``region`` with the engine (``tensor`` is set when it came from one)."""

    @abc.abstractmethod
    def _unregister(self, region: Region) -> None:
        """Unregister ``region`` from the engine."""

    @abc.abstractmethod
    def _local_address(self) -> str:
        """``host:port`` where this engine listens."""

    def _descriptor_extra(self) -> dict[str, str]:
        """Backend-specific strings peers need (default: none)."""
        return {}

    @abc.abstractmethod
    def _connect(self, desc: TransportDescriptor) -> None:
        """Prepare to talk to ``desc``; raise PeerUnreachable/PeerMismatch if impossible."""

    def _disconnect(self, desc: TransportDescriptor) -> None:  # noqa: B027 - optional hook
        """Drop engine state for ``desc`` (default: nothing)."""

    @abc.abstractmethod
    def _submit(
        self,
        op: TransferOp,
        desc: TransportDescriptor,
        local: Region,
        remote: Region,
        spans: np.ndarray,
    ) -> BackendJob:
        """Start one batched transfer of validated, non-empty ``spans``; never block long."""

    @abc.abstractmethod
    def _send_notification(self, desc: TransportDescriptor, payload: bytes, timeout: float) -> None:
        """Deliver ``payload`` to ``desc``; raise TransferError/TransferTimeout on failure."""

    @abc.abstractmethod
    def _receive_notifications(self) -> list[Notification]:
        """Notifications received since the last call."""

    @abc.abstractmethod
    def _close(self) -> None:
        """Release engine resources."""


__all__ = [
    "MAX_GRANTS",
    "BackendJob",
    "Notification",
    "Region",
    "TransferHandle",
    "TransferOp",
    "TransferState",
    "Transport",
    "TransportDescriptor",
    "TransportError",
    "decode_payload",
    "encode_payload",
    "poll_until_done",
]
