"""Worker side of our P/D connectors (runs in each vLLM worker process).

Owns the transport (one region per KV cache tensor), the prefill side's handshake server and
the transfers:

* READ, decode: a transfer thread handshakes with the prefill worker (once per engine),
  checks the KV layout, reads the blocks, then notifies "done" so the prefill side frees them.
* READ, prefill: finished requests' blocks are held under a lease; "done" frees them,
  "renew" extends the lease, and a lease that runs out frees them too. The decode transport
  that claims the lease (``/renew`` right before it reads) is granted read access to exactly
  those blocks until they are freed. When the decode engine has another TP size, each of its
  ranks that reads this rank's heads claims the lease, and "done" from all of them frees it;
  a "done" naming a reading rank that never claimed (it failed before its ``/renew``) closes
  that rank's slot.
* READ, decode, TP sizes differ: each source rank (``parallel.py``) is handshaken, claimed and
  read (the head slices it holds for us), and told "done" once every read completed, or once
  the load failed (each rank handshaken by then).
* WRITE, decode: the transfer thread grants the prefill transport write access to the blocks
  it offers (``POST /write_target``), waits for the prefill side's "written" notice, then
  withdraws the grant (also on failure or timeout). When the TP sizes differ, it offers them
  to every prefill rank holding heads of its own and waits for each one's notice. The notice
  names the hash of the prompt the prefill computed; KV computed for another prompt than the
  request's is refused (:class:`KVRefused`).
* WRITE, prefill: in the step that computes the last prompt tokens, each layer is written
  into the decode blocks as it is saved (if the offer is already there), the rest after the
  step; then "written" is sent, with the prompt's hash, and the blocks are freed. A push
  that fails says so ("written", not ok) only once every write it submitted ended, as the
  decode rank then gives its blocks back to vLLM (``_fail_push``). When the TP
  sizes differ, each decode rank holding heads of ours offers its blocks, and gets our heads
  it holds, in their place (``parallel.head_slices``), and its own "written". When one of
  them cancels the transfer (it failed), the others that offered are told it failed ("written",
  not ok) once nothing more is being written, so they fail their loads at once instead of
  waiting out ``transfer_timeout_s``; offers that come after the cancel are refused.

Every failure ends in the same place: the decode request is reported finished with its blocks
in ``get_block_ids_with_load_errors()`` (or, for hybrid models whose block ids repeat across KV
cache groups, in the transfer results' ``failed_recving``), so vLLM's ``kv_load_failure_policy``
recomputes or fails it; nothing half-loaded is ever used as valid.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from vllm_pd_ext.connectors.common.config import TransferConfig
from vllm_pd_ext.connectors.common.layout import (
    CacheLayout,
    CacheView,
    LayoutMismatch,
    block_spans,
    layout_from_caches,
    state_block_spans,
)
from vllm_pd_ext.connectors.common.leases import LeaseTable
from vllm_pd_ext.connectors.common.metadata import (
    READ,
    WRITE,
    PdTransferMetadata,
    PushSpec,
    RecvSpec,
    RemoteRef,
)
from vllm_pd_ext.connectors.common.parallel import (
    Mamba2State,
    head_slices,
    rank_refusal,
    reader_ranks,
    source_ranks,
    state_page_spans,
    tp_refusal,
)
from vllm_pd_ext.connectors.common.side_channel import (
    SideChannelError,
    SideChannelServer,
    fetch_handshake,
    post_json,
    warn_if_exposed,
)
from vllm_pd_ext.connectors.common.stats import StatsRecorder
from vllm_pd_ext.connectors.common.tracing import TransferSpans
from vllm_pd_ext.transport import (
    TransferHandle,
    TransferOp,
    TransferState,
    Transport,
    TransportClosed,
    TransportDescriptor,
    TransportError,
    backend_class,
)
from vllm_pd_ext.util.throttle import Throttle

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

#: Handshake document format version. 4: ``/cancel`` answers at once, ``settled`` saying
#: whether a write into the decode's blocks is still in flight (the decode asks again until
#: it is not; 3 answered only once none was). 3: layouts carry TP size and rank and each view's
#: heads, ``/renew`` claims carry the decode rank (READ between engines of different TP sizes);
#: 2: ``/write_target`` offers carry the decode worker's ``tp_rank``, and both sides refuse a
#: peer of another TP rank (1: TP size checked only).
HANDSHAKE_VERSION = 4
#: The largest decode TP size a ``/renew`` may name (a bound on the slots it makes us track).
MAX_TP_SIZE = 1024
#: WRITE offers a prefill worker keeps at once (each waits for its prefill request, or for
#: ``_prune_offers``); more are refused.
MAX_OFFERS = 4096
#: The least time a repeated ``/cancel`` is given to answer (its bound nearly over).
_MIN_ASK_S = 0.1
#: A decode asks a prefill rank whose writes into its blocks are in flight again at least
#: this often (at first every 10 ms, backing off).
_MAX_ASK_EVERY_S = 0.2
#: Refused loads are logged at most this often (a replay of params is at anyone's will).
_REFUSAL_LOG_EVERY_S = 10.0


class LoadFailed(RuntimeError):
    """One decode-side load did not complete; the request is recomputed or failed."""


class LeaseExpired(LoadFailed):
    """Prefill side: blocks held for a decode instance were freed unread, their lease over
    (named in the ``kv_hold`` span; counted in ``lease_expiries``)."""


class KVRefused(LoadFailed):
    """A WRITE's KV arrived computed for another prompt than the decode request's (its params
    were replayed with another prompt, or another prefill request claimed the transfer): it
    is never used, and the refusal is counted with the refused params."""


@dataclass
class _Peer:
    """A prefill worker we have handshaken with (TP rank ``rank`` of its engine)."""

    peer_id: str
    layout: CacheLayout
    rank: int = 0


@dataclass
class _Push:
    """Prefill side, WRITE mode: one request's push into decode blocks."""

    spec: PushSpec
    started: float = field(default_factory=time.monotonic)
    views_done: set[tuple[int, int]] = field(default_factory=set)  # (decode rank, view)
    handles: list[Any] = field(default_factory=list)
    nbytes: int = 0
    peer: str | None = None  # the decode engine that offered its blocks, once it has
    cancelled: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)  # submit vs cancel


@dataclass
class _Target:
    """Decode side's offer for a WRITE transfer, as the prefill side received it."""

    peer_id: str
    layout: CacheLayout
    pairs: list[list[tuple[int, int]]]  # per group: (decode block, prompt block position)
    reply_to: str
    received: float = field(default_factory=time.monotonic)


class TransferWorker:
    """Worker-side state; every public method runs on vLLM's worker thread."""

    def __init__(
        self,
        cfg: TransferConfig,
        *,
        engine_id: str,
        role: str,
        tp_rank: int,
        tp_size: int,
        side_host: str,
        side_port: int,
        kv_ip: str,
        num_blocks: int,
        block_sizes: tuple[int, ...],
        model: Mapping[str, Any],
        group_of: Mapping[str, int] | None = None,
        head_major: Mapping[int, int] | None = None,
        heads_first: bool = False,
        states: Mapping[int, Mamba2State] | None = None,
        key: bytes | None = None,
        clock: Callable[[], float] = time.monotonic,
        spans: TransferSpans | None = None,
    ) -> None:
        self.cfg = cfg
        #: The fleet key: tags every side-channel exchange and, where the backend can,
        #: authenticates its data connections (None: nothing is authenticated).
        self.key = key
        self.engine_id = engine_id
        self.role = role  # kv_producer / kv_consumer / kv_both
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.side_host, self.side_port = side_host, side_port + tp_rank
        self.kv_ip = kv_ip
        self.num_blocks, self.block_sizes = num_blocks, tuple(block_sizes)
        self.model = dict(model)
        self.group_of = dict(group_of or {})
        #: KV cache groups laid out heads first -> this rank's KV heads (``layout.py``)
        self.head_major = dict(head_major or {})
        #: the engine's declared KV cache layout puts each block's heads before its tokens
        #: (else the caches' shapes decide, and an ambiguous one is not head-major)
        self.heads_first = heads_first
        #: KV cache groups of Mamba2 state pages -> this rank's state (``parallel.py``)
        self.states = dict(states or {})
        self.stats = StatsRecorder()
        #: Ends the transfer spans of requests that carry a ``traceparent`` (``tracing.py``).
        self.spans = spans or TransferSpans()
        self.transport: Transport | None = None
        self.layout: CacheLayout | None = None
        self._clock = clock
        self._server: SideChannelServer | None = None
        self._pool = ThreadPoolExecutor(
            max_workers=cfg.max_concurrent_transfers, thread_name_prefix="pdext-xfer"
        )
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        self._peer_locks: dict[str, threading.Lock] = {}
        #: prefill engine (``_engine_key``) -> its TP size, as its rank 0's handshake said
        self._prefill_tps: dict[str, int] = {}
        self._meta: PdTransferMetadata | None = None
        # decode side
        self._loads: dict[str, Future] = {}
        self._load_blocks: dict[str, tuple[int, ...]] = {}
        #: transfer id -> (ok, error, the hash of the prompt the prefill computed)
        self._written: dict[tuple[str, str], tuple[bool, str, str | None]] = {}
        #: WRITE transfers a load is waiting for: only their "written" notices are kept, so
        #: notices nobody asked for cannot fill ``_written``.
        self._awaiting: dict[str, set[str]] = {}  # transfer id -> the prefill peers that write
        self._load_errors: set[int] = set()
        self._failed_loads: set[str] = set()
        self._refusal_log = Throttle(_REFUSAL_LOG_EVERY_S)
        # prefill side
        self._leases = LeaseTable(cfg.lease_s, clock=clock)
        self._lease_lock = threading.Lock()  # the side channel renews from its own thread
        #: WRITE transfers the decode side gave up on, with when (at most ``MAX_OFFERS``;
        #: forgotten with the offers, by ``_prune_offers``).
        self._cancelled: dict[str, float] = {}
        #: transfer id -> (when, its writes): a failed push's writes still pending when it
        #: gave up waiting for them; a later ``/cancel`` of the transfer waits for them too
        #: (at most ``MAX_OFFERS``; forgotten with the offers, by ``_prune_offers``).
        self._unsettled: dict[str, tuple[float, list[TransferHandle]]] = {}
        #: req id -> its blocks per group, held under a lease (read mode)
        self._held: dict[str, tuple[tuple[int, ...], ...]] = {}
        #: req id -> the read grants made for its lease's holders
        self._read_grants: dict[str, set[str]] = {}
        #: req id -> (traceparent, when its hold began, ns): held requests that are traced
        self._hold_spans: dict[str, tuple[str, int]] = {}
        self._pushes: dict[str, _Push] = {}  # req id -> push
        self._push_futures: dict[str, Future] = {}
        self._push_confirmed: set[str] = set()
        #: transfer id -> decode TP rank -> its offer
        self._targets: dict[str, dict[int, _Target]] = {}
        self._finished_sending: set[str] = set()
        self._finished_reqs: set[str] = set()

    # ---- setup ----
    @property
    def is_producer(self) -> bool:
        return self.role in ("kv_producer", "kv_both")

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Register every cache tensor with a new transport; start the handshake server."""
        self.layout, tensors = layout_from_caches(
            kv_caches,
            num_blocks=self.num_blocks,
            block_sizes=self.block_sizes,
            model=self.model,
            group_of=self.group_of,
            head_major=self.head_major,
            heads_first=self.heads_first,
            states=self.states,
            tp_size=self.tp_size,
            tp_rank=self.tp_rank,
        )
        settings = dict(self.cfg.backend_settings)
        settings.setdefault("host", self.kv_ip)
        backend = backend_class(self.cfg.backend)
        if backend.fleet_key_scope:
            settings.update(key=self.key, on_refused=self.stats.refused)
        if backend.reports_fallbacks:
            settings.update(on_fallback=self.stats.fallback)
        if self.key is None or backend.fleet_key_scope != "all":
            warn_if_exposed(str(settings["host"]), f"the {self.cfg.backend} KV data server")
        self.transport = backend(**settings)
        # peers reach only the blocks leased or offered to them (where the backend can check)
        self.transport.enforce_grants(on_refused=self.stats.ungranted)
        for name, tensor in tensors.items():
            self.transport.register_tensor(name, tensor)
        if self.is_producer:
            if self.key is None:
                warn_if_exposed(self.side_host, "the KV side channel")
            self._server = SideChannelServer(
                self.side_host,
                self.side_port,
                self.handshake,
                {
                    "/write_target": self._on_write_target,
                    "/cancel": self._on_cancel,
                    "/renew": self._on_renew,
                },
                key=self.key,
                on_refused=self.stats.refused,
                limits=self.cfg.side_channel_limits,
            )
        logger.info(
            "KV transfer ready: %s backend %s, %d regions, %d cache views, layout %s%s",
            self.engine_id,
            self.cfg.backend,
            len(tensors),
            len(self.layout.views),
            self.layout.fingerprint(),
            f", side channel {self.side_host}:{self.side_port}" if self._server else "",
        )

    @property
    def _kv_heads(self) -> int | None:
        """The model's KV heads in all, where known (what the TP matrix is checked against)."""
        heads = self.model.get("kv_heads")
        return heads if isinstance(heads, int) else None

    def handshake(self) -> dict[str, Any]:
        """The document a peer fetches: who we are, how to reach us, our KV layout."""
        assert self.transport is not None and self.layout is not None
        return {
            "v": HANDSHAKE_VERSION,
            "engine_id": self.engine_id,
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "transport": self.transport.descriptor().to_dict(),
            "layout": self.layout.to_dict(),
            "fingerprint": self.layout.fingerprint(),
        }

    def _check_handshake(
        self,
        doc: Mapping[str, Any],
        expect_engine: str | None,
        *,
        peer_is_prefill: bool,
        mode: str = READ,
        rank: int | None = None,
    ) -> CacheLayout:
        """The peer's layout, once its handshake document (``peer_is_prefill``: we meant to
        reach its TP rank ``rank``, by default ours) or WRITE offer matched ours for ``mode``:
        version, engine id, TP sizes (``parallel.py``) and rank, KV layout; LayoutMismatch
        naming the first difference otherwise."""
        if doc.get("v") != HANDSHAKE_VERSION:
            raise LayoutMismatch(
                f"handshake version {doc.get('v')!r}, expected {HANDSHAKE_VERSION}"
            )
        if expect_engine and doc.get("engine_id") != expect_engine:
            raise LayoutMismatch(
                f"side channel answered as engine {doc.get('engine_id')!r}, "
                f"kv_transfer_params named {expect_engine!r}"
            )
        sizes = (doc.get("tp_size"), self.tp_size)
        refusal = tp_refusal(
            *(sizes if peer_is_prefill else sizes[::-1]), mode=mode, kv_heads=self._kv_heads
        ) or rank_refusal(self.tp_rank, doc.get("tp_rank"), rank)
        if refusal is not None:
            raise LayoutMismatch(refusal)
        layout = CacheLayout.from_dict(doc["layout"])
        if (layout.tp_size, layout.tp_rank) != (doc.get("tp_size"), doc.get("tp_rank")):
            raise LayoutMismatch(
                f"the peer says TP rank {doc.get('tp_rank')!r} of {doc.get('tp_size')!r}, its "
                f"KV layout rank {layout.tp_rank} of {layout.tp_size}"
            )
        assert self.layout is not None
        self.layout.check_compatible(layout)
        return layout

    def _source_ranks(self, remote: RemoteRef) -> list[int]:
        """The TP ranks of prefill engine ``remote`` whose KV this rank loads (its own rank
        when the TP sizes are equal)."""
        if remote.tp_size is None or remote.tp_size == self.tp_size:
            return [self.tp_rank]
        return source_ranks(self.tp_rank, self.tp_size, remote.tp_size)

    def _peer(self, remote: RemoteRef, rank: int | None = None, mode: str = READ) -> _Peer:
        """Handshake with TP rank ``rank`` (default: ours) of a prefill engine once (per
        engine id), for ``mode``; raise on any mismatch."""
        rank = self.tp_rank if rank is None else rank
        key = f"{_engine_key(remote)}#{rank}"
        with self._lock:
            peer = self._peers.get(key)
            lock = self._peer_locks.setdefault(key, threading.Lock())
        if peer is not None:
            return peer
        with lock:
            with self._lock:
                peer = self._peers.get(key)
            if peer is not None:
                return peer
            doc = fetch_handshake(
                remote.host, remote.port + rank, self.cfg.handshake_timeout_s, self.key
            )
            layout = self._check_handshake(
                doc, remote.engine_id or None, peer_is_prefill=True, mode=mode, rank=rank
            )
            assert self.transport is not None
            peer_id = self.transport.connect(TransportDescriptor.from_dict(doc["transport"]))
            peer = _Peer(peer_id, layout, rank)
            with self._lock:
                self._peers[key] = peer
            logger.info("handshake with %s (%s) done", remote.engine_id, key)
            return peer

    def _forget_peer(self, remote: RemoteRef) -> None:
        engine = _engine_key(remote)
        prefix = f"{engine}#"
        with self._lock:
            for key in [k for k in self._peers if k.startswith(prefix)]:
                del self._peers[key]
            self._prefill_tps.pop(engine, None)

    def _prefill_tp(self, remote: RemoteRef) -> int:
        """The TP size of prefill engine ``remote``, from its rank 0's handshake (checked as
        a WRITE's), fetched once per engine; no transport connection is opened to rank 0 for
        it (only a rank we load from gets one, in :meth:`_peer`)."""
        engine = _engine_key(remote)
        with self._lock:
            known = self._prefill_tps.get(engine)
        if known is not None:
            return known
        doc = fetch_handshake(remote.host, remote.port, self.cfg.handshake_timeout_s, self.key)
        layout = self._check_handshake(
            doc, remote.engine_id or None, peer_is_prefill=True, mode=WRITE, rank=0
        )
        with self._lock:
            self._prefill_tps[engine] = layout.tp_size
        return layout.tp_size

    def _grant_spans(self, blocks: Sequence[Sequence[int]]) -> dict[str, np.ndarray] | None:
        """Per region, the (offset, length) spans of blocks ``blocks[g]`` of each KV cache
        group ``g`` (block 0, vLLM's null block, never) in every cache view; None when the
        transport enforces no grants (nothing to compute)."""
        assert self.transport is not None and self.layout is not None
        if not self.transport.enforces_grants:
            return None
        spans: dict[str, list[np.ndarray]] = {}
        for view in self.layout.views:
            ids = [b for b in (blocks[view.group] if view.group < len(blocks) else ()) if b]
            if ids:
                rows = block_spans(view, view, [(b, b) for b in ids])
                spans.setdefault(view.region, []).append(rows[:, [0, 2]])
        return {region: np.concatenate(s) for region, s in spans.items()}

    def _grant(
        self,
        grant_id: str,
        op: TransferOp,
        peer_id: str,
        spans: dict[str, np.ndarray] | None,
    ) -> None:
        """Let transport ``peer_id`` ``op`` the ``spans`` (from :meth:`_grant_spans`) until
        :meth:`_revoke`; nothing when they are None."""
        assert self.transport is not None
        if spans is not None:
            self.transport.grant(grant_id, op, peer_id, spans)

    def _revoke(self, grant_id: str) -> None:
        if self.transport is not None:
            self.transport.revoke(grant_id)

    def _notify(self, peer_id: str, body: dict[str, Any]) -> None:
        assert self.transport is not None
        self.transport.notify(
            peer_id, json.dumps(body).encode(), timeout=self.cfg.handshake_timeout_s
        )

    # ---- per step ----
    def bind(self, meta: PdTransferMetadata) -> None:
        """Take this step's metadata (called before the forward pass)."""
        self._meta = meta
        for spec in meta.send:
            if spec.mode == READ:
                with self._lease_lock:
                    self._held[spec.req_id] = spec.block_ids
                    self._leases.grant(spec.req_id)
                    if spec.traceparent is not None:
                        self._hold_spans[spec.req_id] = (spec.traceparent, time.time_ns())
            else:
                self._push_confirmed.add(spec.req_id)
        for push in meta.push:
            self._pushes[push.req_id] = _Push(push)

    def start_load_kv(self) -> None:
        """Start this step's loads and lease messages (non-blocking)."""
        meta = self._meta
        if meta is None:
            return
        for spec in meta.recv:
            self._load_blocks[spec.req_id] = tuple(b for g in spec.local_block_ids for b in g)
            self._loads[spec.req_id] = self._pool.submit(self._load, spec)
        for ref in meta.renew:
            self._pool.submit(self._send_quietly, ref, {"op": "renew"})
        for ref in meta.release:
            self._pool.submit(self._send_quietly, ref, self._done_notice())

    def _done_notice(self) -> dict[str, Any]:
        """The "done" notice of a READ: it names this decode rank (``decode_engine``,
        ``tp_rank``), so a prefill rank whose lease has a slot for it that it never claimed
        (it failed before its ``/renew``) closes that slot."""
        return {"op": "done", "decode_engine": self.engine_id, "tp_rank": self.tp_rank}

    def _send_quietly(self, remote: RemoteRef, body: dict[str, Any]) -> None:
        """Send ``body`` about a READ to every prefill rank we load from; log failures."""
        for rank in self._source_ranks(remote):
            try:
                peer = self._peer(remote, rank)
            except (TransportError, SideChannelError, LayoutMismatch, OSError) as e:
                self._log_unsent(remote, rank, body, e)
                continue
            self._notify_quietly(remote, peer, body)

    def _notify_quietly(self, remote: RemoteRef, peer: _Peer, body: dict[str, Any]) -> None:
        """Send ``body`` about the READ of ``remote`` to prefill rank ``peer``; log a failure."""
        try:
            self._notify(peer.peer_id, {**body, "req": remote.request_id})
        except (TransportError, OSError) as e:
            self._log_unsent(remote, peer.rank, body, e)

    @staticmethod
    def _log_unsent(remote: RemoteRef, rank: int, body: Mapping[str, Any], e: Exception) -> None:
        logger.warning(
            "could not send %s for %s to %s (TP rank %d): %s",
            body.get("op"),
            remote.request_id,
            remote.host,
            rank,
            e,
        )

    def _load(self, spec: RecvSpec) -> None:
        """Transfer thread: complete one decode-side load or raise :class:`LoadFailed`; a
        traced request's ends its ``kv_load`` span."""
        if spec.traceparent is None:
            self._run_load(spec)
            return
        start, nbytes, error = time.time_ns(), 0, None
        try:
            nbytes = self._run_load(spec)
        except BaseException as e:
            error = e
            raise
        finally:
            self.spans.record(
                "kv_load",
                spec.traceparent,
                start,
                outcome="ok" if error is None else _failure(error),
                error=error,
                address=(spec.remote.host, spec.remote.port + self._source_ranks(spec.remote)[0]),
                mode=spec.mode,
                bytes=nbytes,
                peer=spec.remote.engine_id or None,
                request_id=spec.req_id,
            )

    def _run_load(self, spec: RecvSpec) -> int:
        """:meth:`_load`'s work: the bytes this side moved (a WRITE's decode side: none)."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.cfg.transfer_timeout_s
        try:
            assert self.transport is not None and self.layout is not None
            if spec.mode == READ:
                reached: list[_Peer] = []
                try:
                    nbytes = self._run_read(spec, reached, deadline)
                finally:
                    # The KV is ours, or this load failed (before its claim too): either way
                    # every prefill rank we reached frees its blocks now; a rank we could not
                    # reach frees them at its lease's end.
                    for peer in reached:
                        self._notify_quietly(spec.remote, peer, self._done_notice())
            else:
                nbytes = self._run_write(spec, deadline)
        except KVRefused as e:
            self.stats.params_refused()
            if self._refusal_log.ready():
                logger.warning(
                    "request %s: refused the KV written for it, computing the prompt locally "
                    "(or failing it, per kv_load_failure_policy): %s",
                    spec.req_id,
                    e,
                )
            raise
        except (TransportError, SideChannelError, LayoutMismatch, LoadFailed, OSError) as e:
            self.stats.failure(spec.remote.engine_id)
            if isinstance(e, TransportError | SideChannelError):
                self._forget_peer(spec.remote)
            raise LoadFailed(
                f"KV load of {spec.req_id} from {spec.remote.host}:{spec.remote.port} failed: {e}"
            ) from e
        self.stats.transfer(time.perf_counter() - t0, nbytes, spec.remote.engine_id)
        return nbytes

    def _write_sources(self, remote: RemoteRef) -> list[_Peer]:
        """The prefill ranks that write our KV heads in a WRITE: the rank of our index when
        the prefill engine has our TP size, else every rank whose heads overlap ours. Its TP
        size: the one ``remote`` names (refused if we cannot pair with it; each rank's
        handshake must agree), else learnt from its rank 0's handshake (:meth:`_prefill_tp`:
        a WRITE's params do not carry it)."""
        prefill_tp = remote.tp_size
        if prefill_tp is None:
            prefill_tp = self._prefill_tp(remote)
        elif refusal := tp_refusal(prefill_tp, self.tp_size, mode=WRITE, kv_heads=self._kv_heads):
            raise LayoutMismatch(refusal)
        if prefill_tp == self.tp_size:
            ranks = [self.tp_rank]
        else:
            ranks = source_ranks(self.tp_rank, self.tp_size, prefill_tp)
        peers = [self._peer(remote, r, mode=WRITE) for r in ranks]
        for peer in peers:
            if peer.layout.tp_size != prefill_tp:
                raise LayoutMismatch(
                    f"the WRITE params said prefill TP {prefill_tp}; its rank {peer.rank} has "
                    f"TP {peer.layout.tp_size}"
                )
        return peers

    def _run_write(self, spec: RecvSpec, deadline: float) -> int:
        """A WRITE's decode side: offer our blocks to each prefill rank that writes our heads
        (granting its transport write access to them, nothing else), wait for each one's
        "written" notice; the grants are withdrawn however it ends. Moves no bytes itself."""
        assert self.transport is not None and self.layout is not None
        tid = str(spec.transfer_id)
        grants: list[str] = []
        try:
            peers = self._write_sources(spec.remote)
            with self._lock:
                self._awaiting[tid] = {p.peer_id for p in peers}
            spans = self._grant_spans([[d for d, _ in group] for group in spec.pairs])
            offer = {
                "transfer_id": spec.transfer_id,
                "engine_id": self.engine_id,
                "transport": self.transport.descriptor().to_dict(),
                "layout": self.layout.to_dict(),
                "pairs": [[list(pair) for pair in group] for group in spec.pairs],
                "v": HANDSHAKE_VERSION,
                "tp_size": self.tp_size,
                "tp_rank": self.tp_rank,
            }
            posted: list[_Peer] = []
            try:
                for peer in peers:
                    # the prefill rank's transport may write into the blocks we offer, only
                    grants.append(_write_grant(tid, peer.rank))
                    self._grant(grants[-1], TransferOp.WRITE, peer.peer_id, spans)
                    posted.append(peer)  # before the post: its offer may land, its answer not
                    try:
                        post_json(
                            spec.remote.host,
                            spec.remote.port + peer.rank,
                            "/write_target",
                            offer,
                            self.cfg.handshake_timeout_s,
                            self.key,
                        )
                    except SideChannelError as e:
                        if e.status is not None and 400 <= e.status < 500:
                            posted.pop()  # refused: nothing of ours to withdraw there
                        raise
            except Exception:
                # the load fails and our blocks go back to vLLM: withdraw every offer made
                self._cancel_writes(spec.remote, [p.rank for p in posted], tid)
                raise
            return self._await_written(spec, peers, deadline)
        finally:
            # written, failed or timed out (then cancelled): nothing more may land
            for grant in grants:
                self._revoke(grant)
            with self._lock:
                writers = self._awaiting.pop(tid, set())
                for writer in writers:
                    self._written.pop((tid, writer), None)

    def _run_read(self, spec: RecvSpec, reached: list[_Peer], deadline: float) -> int:
        """A READ's handshakes (each prefill rank handshaken is added to ``reached``), claims
        and reads; the bytes moved."""
        assert self.transport is not None
        for r in self._source_ranks(spec.remote):
            reached.append(self._peer(spec.remote, r))
        remote_tp = spec.remote.tp_size or self.tp_size
        for peer in reached:
            if peer.layout.tp_size != remote_tp:
                raise LayoutMismatch(
                    f"the READ answer said prefill TP {remote_tp}; its rank "
                    f"{peer.rank} has TP {peer.layout.tp_size}"
                )
        # Claim the blocks of every source rank (each then lets our transport read them, and
        # only the decode ranks that claimed them); they must still be held, and stay held
        # while we read: renew synchronously, then finish well inside the new lease: the
        # first rank's, from before its renewal, ends first.
        claimed = time.monotonic()
        for peer in reached:
            post_json(
                spec.remote.host,
                spec.remote.port + peer.rank,
                "/renew",
                {
                    "req": spec.remote.request_id,
                    "engine_id": self.transport.engine_id,
                    "decode_engine": self.engine_id,
                    "tp_size": self.tp_size,
                    "tp_rank": self.tp_rank,
                },
                self.cfg.handshake_timeout_s,
                self.key,
            )
        if spec.lease_s:
            deadline = min(deadline, claimed + 0.8 * spec.lease_s)
        nbytes = self._read(reached, spec.pairs, deadline)
        if time.monotonic() > deadline:
            raise LoadFailed("the read ended after the prefill side's lease could end")
        return nbytes

    def _read(self, peers: Sequence[_Peer], pairs: Any, deadline: float) -> int:
        """Read ``pairs[g]`` (local, remote) blocks of each group ``g`` for every cache view
        from the prefill ranks ``peers`` (of another TP size: the head slices each holds for
        us); return bytes moved."""
        assert self.transport is not None and self.layout is not None
        handles, nbytes = [], 0
        for peer in peers:
            split = peer.layout.tp_size != self.tp_size
            for mine, theirs in zip(self.layout.views, peer.layout.views, strict=True):
                if split and mine.state is not None:
                    spans = _state_spans(mine, self.tp_rank, theirs, peer.rank, pairs[mine.group])
                elif split:
                    total = mine.heads * self.tp_size
                    slices = head_slices(self.tp_rank, self.tp_size, peer.layout.tp_size, total)
                    parts = [
                        block_spans(mine, theirs, pairs[mine.group], s)
                        for s in slices
                        if s.remote_rank == peer.rank
                    ]
                    spans = np.concatenate(parts) if parts else np.empty((0, 3), np.int64)
                else:
                    spans = block_spans(mine, theirs, pairs[mine.group])
                if not len(spans):
                    continue
                handles.append(self.transport.read(peer.peer_id, mine.region, theirs.region, spans))
                nbytes += int(spans[:, 2].sum())
        self.transport.wait_all(handles, max(0.0, deadline - time.monotonic()))
        return nbytes

    def _await_written(self, spec: RecvSpec, peers: Sequence[_Peer], deadline: float) -> int:
        """Wait for the "written" notice of every prefill rank in ``peers``; on a failed or
        refused one, or none in time, make sure the ranks still writing stop first."""
        transfer_id = str(spec.transfer_id)
        pending = {p.peer_id: p for p in peers}
        try:
            while pending:
                if time.monotonic() >= deadline:
                    raise LoadFailed(f"no 'written' notice for transfer {transfer_id} in time")
                with self._lock:
                    results = [
                        (w, self._written.pop((transfer_id, w)))
                        for w in list(pending)
                        if (transfer_id, w) in self._written
                    ]
                for writer, (ok, error, computed) in results:
                    del pending[writer]
                    if not ok:
                        raise LoadFailed(f"prefill side reported: {error}")
                    if spec.prompt_hash is None or computed != spec.prompt_hash:
                        raise KVRefused(
                            f"transfer {transfer_id} was computed for another prompt (hash "
                            f"{str(computed)[:32]}, this request's {spec.prompt_hash})"
                        )
                if pending:
                    time.sleep(0.002)
            return 0
        except LoadFailed:
            # Our blocks are freed once we report this load: first make sure no prefill rank
            # writes anything more into them.
            self._cancel_writes(spec.remote, [p.rank for p in pending.values()], transfer_id)
            raise

    def _cancel_writes(self, remote: RemoteRef, ranks: Sequence[int], transfer_id: str) -> None:
        """Withdraw our offer for ``transfer_id`` from each prefill rank of ``ranks`` (naming
        our TP rank, so that it tells only the other decode ranks that the transfer failed);
        return once each answered that no write of its into our blocks is in flight any more
        (asking again while one is), or could not be asked, or ``handshake_timeout_s`` after
        the first ask: our blocks go back to vLLM then."""
        deadline = time.monotonic() + self.cfg.handshake_timeout_s
        asking, delay = list(ranks), 0.01
        while True:
            asking = [r for r in asking if not self._cancel_write(remote, r, transfer_id, deadline)]
            if not asking or time.monotonic() >= deadline:
                break
            time.sleep(delay)
            delay = min(2 * delay, _MAX_ASK_EVERY_S)
        if asking:
            logger.error(
                "transfer %s: prefill TP rank(s) %s still writing into our blocks %.0fs after "
                "the cancel; giving them back anyway",
                transfer_id,
                asking,
                self.cfg.handshake_timeout_s,
            )

    def _cancel_write(
        self, remote: RemoteRef, rank: int, transfer_id: str, deadline: float
    ) -> bool:
        """Post one ``/cancel`` of ``transfer_id`` to prefill rank ``rank``: False while it
        answers that a write of its into our blocks is still in flight."""
        assert self.transport is not None
        try:
            answer = post_json(
                remote.host,
                remote.port + rank,
                "/cancel",
                {
                    "transfer_id": transfer_id,
                    "tp_rank": self.tp_rank,
                    "engine_id": self.transport.engine_id,
                },
                max(deadline - time.monotonic(), _MIN_ASK_S),
                self.key,
            )
        except SideChannelError as e:
            logger.warning("could not cancel transfer %s on the prefill side: %s", transfer_id, e)
            return True
        return answer.get("settled") is not False

    # ---- prefill side, WRITE mode ----
    def _on_write_target(self, body: dict[str, Any]) -> None:
        """Side-channel thread: a decode worker's offer for transfer ``transfer_id``."""
        assert self.transport is not None
        decode_tp, rank = body.get("tp_size"), None
        if (
            isinstance(decode_tp, int)
            and decode_tp != self.tp_size
            and 1 <= decode_tp <= MAX_TP_SIZE
        ):
            rank = body.get("tp_rank")  # a decode of another size: any rank holding our heads
            if rank not in reader_ranks(self.tp_rank, self.tp_size, decode_tp):
                raise ValueError(f"decode TP rank {rank!r} of {decode_tp} holds no head of ours")
        layout = self._check_handshake(body, None, peer_is_prefill=False, mode=WRITE, rank=rank)
        pairs = [[(int(d), int(i)) for d, i in group] for group in body["pairs"]]
        if any(d < 0 or i < 0 for group in pairs for d, i in group):
            raise ValueError("an offer's block ids and prompt positions are not negative")
        peer_id = self.transport.connect(TransportDescriptor.from_dict(body["transport"]))
        target = _Target(
            peer_id=peer_id, layout=layout, pairs=pairs, reply_to=str(body["engine_id"])
        )
        tid = str(body["transfer_id"])
        with self._lock:
            if tid in self._cancelled:
                raise ValueError(f"transfer {tid} was cancelled by the decode side")
            offers = self._targets.get(tid)
            if offers is None:
                if len(self._targets) >= MAX_OFFERS:
                    raise ValueError(f"{MAX_OFFERS} offers are waiting already")
                offers = self._targets[tid] = {}
            if layout.tp_rank in offers:
                raise ValueError(f"transfer {tid} already has a target: the first offer stands")
            if any(o.layout.tp_size != layout.tp_size for o in offers.values()):
                raise ValueError(f"transfer {tid} has offers of another decode TP size")
            offers[layout.tp_rank] = target

    def _writes_to(self, decode_tp: int) -> list[int]:
        """The decode ranks (of ``decode_tp``) a WRITE of ours fills: the rank of our index,
        or, between TP sizes, every rank holding heads of ours."""
        if decode_tp == self.tp_size:
            return [self.tp_rank]
        return reader_ranks(self.tp_rank, self.tp_size, decode_tp)

    def _offers(self, tid: str, complete: bool = False) -> list[_Target]:
        """The decode offers for transfer ``tid`` so far (``complete``: none until every
        decode rank we write has offered)."""
        with self._lock:
            offers = dict(self._targets.get(tid, {}))
        if not offers:
            return []
        expected = self._writes_to(next(iter(offers.values())).layout.tp_size)
        if complete and not set(expected) <= offers.keys():
            return []
        return [offers[r] for r in sorted(offers)]

    def _push_pairs(self, push: _Push, target: _Target) -> list[np.ndarray]:
        """Per group: (our block, decode block) for each position the decode side offered."""
        out = []
        for ours, offered in zip(push.spec.block_ids, target.pairs, strict=True):
            rows = [(ours[i], d) for d, i in offered if i < len(ours) and ours[i] != 0]
            out.append(np.asarray(rows, dtype=np.int64).reshape(-1, 2))
        return out

    def save_kv_layer(self, layer_name: str) -> None:
        """Write ``layer_name``'s views to every decode target already known (non-blocking)."""
        if not self._pushes or self.layout is None or self.transport is None:
            return
        # a view shared by several layers is written once, after its last layer
        views = [i for i, v in enumerate(self.layout.views) if v.layers[-1] == layer_name]
        for push in self._pushes.values():
            if push.spec.req_id in self._push_futures:
                continue
            try:
                for target in self._offers(push.spec.transfer_id):
                    pairs = self._push_pairs(push, target)
                    for i in views:
                        if (target.layout.tp_rank, i) not in push.views_done:
                            self._write_view(push, target, i, pairs)
            except (TransportError, LayoutMismatch) as e:
                logger.warning(
                    "layer push of %s failed, retrying after the step: %s", push.spec.req_id, e
                )
            except LoadFailed:  # cancelled by the decode side meanwhile: nothing more to write
                logger.debug("layer push of %s cancelled by the decode side", push.spec.req_id)

    def _write_view(self, push: _Push, target: _Target, i: int, pairs: list[np.ndarray]) -> None:
        """Submit the write of cache view ``i`` of ``push`` (non-blocking)."""
        assert self.transport is not None and self.layout is not None
        mine, theirs = self.layout.views[i], target.layout.views[i]
        rank, decode_tp = target.layout.tp_rank, target.layout.tp_size
        if decode_tp == self.tp_size:
            spans = block_spans(mine, theirs, pairs[mine.group])
        elif mine.state is not None:  # the parts of our state pages decode rank ``rank`` holds
            reverse = pairs[mine.group][:, ::-1]  # (decode block, ours)
            spans = _state_spans(theirs, rank, mine, self.tp_rank, reverse)[:, [1, 0, 2]]
        else:  # the head slices of ours that decode rank ``rank`` holds, into their place
            reverse = pairs[mine.group][:, ::-1]  # (decode block, ours)
            parts = [
                block_spans(theirs, mine, reverse, s)[:, [1, 0, 2]]
                for s in head_slices(rank, decode_tp, self.tp_size, mine.heads * self.tp_size)
                if s.remote_rank == self.tp_rank
            ]
            spans = np.concatenate(parts) if parts else np.empty((0, 3), np.int64)
        with push.lock:
            if push.cancelled:
                raise LoadFailed("the decode side cancelled the transfer")
            if len(spans):
                push.handles.append(
                    self.transport.write(target.peer_id, mine.region, theirs.region, spans)
                )
                push.nbytes += int(spans[:, 2].sum())
            push.views_done.add((rank, i))

    def _on_cancel(self, body: dict[str, Any]) -> dict[str, Any]:
        """Side-channel thread: the decode side (its TP rank ``tp_rank``, transport
        ``engine_id``) gave up on a WRITE transfer. Answers at once: ``settled``, whether
        every write of ours into its blocks (without ``engine_id``: the transfer's) already
        ended (:meth:`_fail_push` says when one can land no more); until it says so
        the decode rank keeps its blocks and asks again (a repeated ``/cancel`` answers the
        same way). From the first one on nothing more is written for the transfer and later
        offers for it are refused; every other decode rank that offered blocks for it is
        told it failed (on a transfer thread), each once the writes into its blocks ended."""
        tid = str(body["transfer_id"])
        with self._lock:
            self._cancelled.pop(tid, None)
            if len(self._cancelled) >= MAX_OFFERS:  # the oldest: its offer was withdrawn anyway
                del self._cancelled[next(iter(self._cancelled))]
            self._cancelled[tid] = time.monotonic()
            offers = self._targets.pop(tid, {})
            pushes = [p for p in self._pushes.values() if p.spec.transfer_id == tid]
            handles = list(self._unsettled.get(tid, (0.0, []))[1])
        for push in pushes:
            with push.lock:  # no write of it is submitted after this
                push.cancelled = True
                handles += push.handles
        pending = [h for h in handles if h.poll() is TransferState.PENDING]
        if pending:
            self._keep_unsettled(tid, pending)
        else:
            with self._lock:
                self._unsettled.pop(tid, None)
        canceller = body.get("tp_rank")  # None from a decode that does not name it: tell all
        others = [o for r, o in offers.items() if r != canceller]
        if others:
            error = f"decode TP rank {canceller} cancelled transfer {tid}"
            notice = _written_notice(tid, False, error, None)
            self._pool.submit(self._tell_others, tid, others, pending, notice)
        writer = body.get("engine_id")
        return {"settled": not [h for h in pending if writer is None or h.peer == writer]}

    def _tell_others(
        self,
        tid: str,
        targets: Sequence[_Target],
        handles: Sequence[TransferHandle],
        notice: dict[str, Any],
    ) -> None:
        """Transfer thread: after a cancel of ``tid``, tell each decode rank of ``targets``
        that it failed once none of ``handles`` into its blocks is pending."""
        try:
            untold, _ = self._tell_once_settled(targets, handles, notice)
        except TransportClosed:
            return
        self._log_untold(untold, tid)

    def _tell_failed(self, targets: Sequence[_Target], notice: dict[str, Any]) -> None:
        """Transfer thread: send each decode rank of ``targets`` the failed transfer's
        "written" ``notice`` (nothing more is written into its blocks); log the ones we
        cannot reach."""
        for target in targets:
            try:
                self._notify(target.peer_id, notice)
            except (TransportError, OSError) as e:
                logger.warning(
                    "could not tell decode TP rank %d that transfer %s failed: %s",
                    target.layout.tp_rank,
                    notice["transfer_id"],
                    e,
                )

    def _on_renew(self, body: dict[str, Any]) -> None:
        """Side-channel thread: extend a lease, and bind its blocks to the decode transport
        that will read them (``engine_id``; the first claim stands), which is then granted
        read access to them; ``ValueError`` (400) if none is held, another peer claimed it
        or no grant can be made. A decode engine of another TP size (``tp_size``) claims
        with each rank that reads ours (``tp_rank``, of engine ``decode_engine``): the first
        claim names the ranks that must all claim and say done."""
        req, peer = str(body["req"]), body.get("engine_id")
        slot, slots = self._claim_slots(body)
        # The spans are computed outside the lock (the worker thread takes it every step);
        # only the claim and the registration happen under it.
        blocks = self._held.get(req) if peer is not None else None
        spans = self._grant_spans(blocks) if blocks is not None else None
        with self._lease_lock:
            engine = body.get("decode_engine")
            holder = (
                self._leases.claim(
                    req, str(peer), slot, slots, engine=str(engine) if engine else None
                )
                if peer is not None
                else None
            )
            if holder is not None and holder != peer:
                raise ValueError(f"the blocks of {req} are leased to another peer")
            if not self._leases.renew(req):
                raise ValueError(f"no blocks held for {req} (lease over or never granted)")
            if holder is not None:  # under the lock: a release revokes only after this
                held = self._held.get(req, ())
                if held is not blocks:  # held (anew) since the spans were computed
                    spans = self._grant_spans(held)
                grant = _read_grant(req) if slot is None else f"{_read_grant(req)}#{holder}"
                self._read_grants.setdefault(req, set()).add(grant)
                self._grant(grant, TransferOp.READ, holder, spans)

    def _claim_slots(self, body: Mapping[str, Any]) -> tuple[Any, list[Any] | None]:
        """The lease slot a ``/renew`` claims and every slot its decode engine will claim:
        (None, None) for a decode engine of our TP size (one reader); else (decode engine,
        rank) pairs, of the decode ranks that read ours; ``ValueError`` for TP sizes we
        cannot serve."""
        decode_tp = body.get("tp_size", self.tp_size)
        if decode_tp == self.tp_size:
            return None, None
        if not isinstance(decode_tp, int) or not 1 <= decode_tp <= MAX_TP_SIZE:
            raise ValueError(f"decode TP size {decode_tp!r} is not one in 1..{MAX_TP_SIZE}")
        refusal = tp_refusal(self.tp_size, decode_tp, kv_heads=self._kv_heads)
        if refusal is not None:
            raise ValueError(refusal)
        engine, rank = str(body.get("decode_engine")), body.get("tp_rank")
        readers = reader_ranks(self.tp_rank, self.tp_size, decode_tp)
        if rank not in readers:
            raise ValueError(f"decode TP rank {rank!r} of {decode_tp} reads no head of ours")
        return (engine, rank), [(engine, q) for q in readers]

    def wait_for_save(self) -> None:
        """Hand each push of this step to a transfer thread that completes it."""
        for req_id, push in self._pushes.items():
            if req_id not in self._push_futures:
                self._push_futures[req_id] = self._pool.submit(self._finish_push, push)

    def _finish_push(self, push: _Push) -> None:
        """Transfer thread: wait for the decode offer, write what is left, say "written"; a
        traced request's ends its ``kv_push`` span."""
        traceparent = push.spec.traceparent
        if traceparent is None:
            self._run_push(push)
            return
        start = time.time_ns()
        error: BaseException | None = None
        try:
            error = self._run_push(push)
        except BaseException as e:
            error = e
            raise
        finally:
            self.spans.record(
                "kv_push",
                traceparent,
                start,
                outcome="ok" if error is None else _failure(error),
                error=error,
                mode=WRITE,
                bytes=push.nbytes if error is None else None,
                peer=push.peer,
                request_id=push.spec.req_id,
            )

    def _run_push(self, push: _Push) -> Exception | None:
        """:meth:`_finish_push`'s work: None once "written" went out, else what failed it
        (raised when no decode offer came within the lease, or on an error we did not
        expect). However it fails, no decode rank is told so while a write into its blocks
        may still land (:meth:`_fail_push`)."""
        assert self.transport is not None and self.layout is not None
        tid = push.spec.transfer_id
        deadline = push.started + self.cfg.lease_s
        targets: list[_Target] = []
        while time.monotonic() < deadline and tid not in self._cancelled:
            targets = self._offers(tid, complete=True)
            if targets:
                break
            time.sleep(0.002)
        if not targets:
            if tid in self._cancelled:  # the decode side gave up: no lease ran out
                raise LoadFailed(f"the decode side cancelled transfer {tid}")
            self.stats.lease_expired()
            failure = LoadFailed(f"no decode offer for transfer {tid} within the lease")
            # decode ranks that did offer (TP sizes differ) may hold layer pushes already
            self._fail_push(push, self._offers(tid), failure)
            raise failure
        push.peer = targets[0].reply_to
        t0 = time.perf_counter()
        try:
            for target in targets:
                pairs = self._push_pairs(push, target)
                for i in range(len(self.layout.views)):
                    if (target.layout.tp_rank, i) not in push.views_done:
                        self._write_view(push, target, i, pairs)
            self.transport.wait_all(push.handles, max(0.0, deadline - time.monotonic()))
            # Only vouch for the bytes once the scheduler confirmed it kept the blocks.
            while push.spec.req_id not in self._push_confirmed:
                if push.cancelled:  # nobody waits for our word any more
                    raise LoadFailed(f"the decode side cancelled transfer {tid}")
                if push.spec.req_id in self._finished_reqs or time.monotonic() > deadline:
                    raise LoadFailed("the prefill request ended without keeping its blocks")
                time.sleep(0.002)
        except Exception as e:
            self.stats.failure(push.peer)
            self._fail_push(push, targets, e)
            if not isinstance(e, (TransportError, LayoutMismatch, LoadFailed)):
                raise
            return e
        finally:
            with self._lock:
                self._targets.pop(tid, None)
        self.stats.transfer(time.perf_counter() - t0, push.nbytes, push.peer)
        notice = _written_notice(tid, True, "", push.spec.prompt_hash)
        for target in targets:
            self._notify(target.peer_id, notice)
        return None

    def _fail_push(self, push: _Push, targets: Sequence[_Target], error: BaseException) -> None:
        """Tell each decode rank of ``targets`` that ``push`` failed ("written", not ok), so
        it fails its load at once, but only once no write of ours into its blocks can still
        land: it gives them back to vLLM (recompute, another request) as soon as it is told.

        Each decode rank is told once every write submitted into its blocks ended (done or
        failed), within ``transfer_timeout_s`` in all (by then the decode rank gave up waiting
        for our notice and cancels: its ``/cancel`` is answered "not settled" while the same
        writes are pending, :meth:`_on_cancel`); the others are not kept waiting for it. What we
        rely on, per backend: a write handle that is no longer pending lands nothing more.
        tcp: done means the receiver answered once the bytes were in place; failed means it
        refused the write before receiving any of it (FAIL, payload drained), or that the
        connection died (peer gone, ``io_timeout_s`` without progress, transport closed): the
        one exception, as the receiver still copies what its socket buffers already held
        before it sees the end (moments, a few MiB at most). cma: as tcp, the copy being the
        receiver's ``process_vm_readv`` before its answer (on a dead connection, the one
        call in progress). mooncake: the handle ends (done or failed) only once the
        engine's synchronous batch call of its last chunk returned, every chunk before it
        posted and returned (``batching.py``). mori: done once every work request was
        acknowledged; failed once every chunk's status is final, and with one queue pair
        per transfer (``qp_per_transfer``, see ``transport/mori.py``). None of them stops a
        write whose *wait* timed out: it is still on its way. So a decode rank one of whose
        writes is still pending at the bound is not told (it fails at its own
        ``transfer_timeout_s``), and those writes are kept for its ``/cancel`` to ask after.
        Not told either when the decode side cancelled the transfer: it stopped listening,
        and ``_on_cancel`` took the writes and the other ranks over."""
        tid = push.spec.transfer_id
        notice = _written_notice(tid, False, str(error), push.spec.prompt_hash)
        # a cancel meanwhile ends the telling, not the wait (the push ends last)
        try:
            untold, pending = self._tell_once_settled(
                targets, push.handles, notice, quiet=lambda: push.cancelled
            )
        except TransportClosed:  # shutting down: nobody can be told anything
            return
        if push.cancelled:  # the cancel took its writes over (``_on_cancel``)
            return
        if pending:
            self._keep_unsettled(tid, pending)
        self._log_untold(untold, tid)

    def _tell_once_settled(
        self,
        targets: Sequence[_Target],
        handles: Sequence[TransferHandle],
        notice: dict[str, Any],
        quiet: Callable[[], bool] = lambda: False,
    ) -> tuple[list[_Target], list[TransferHandle]]:
        """Tell each decode rank of ``targets`` the failed transfer's "written" ``notice``
        once none of ``handles`` into its blocks is pending (done or failed), within
        ``transfer_timeout_s`` in all; none once ``quiet()`` (the wait goes on). Returns the
        ranks not told and the handles still pending then; :class:`TransportClosed` when the
        transport closed meanwhile."""
        untold, pending = list(targets), list(handles)
        deadline = time.monotonic() + self.cfg.transfer_timeout_s
        while True:
            pending = [h for h in pending if h.poll() is TransferState.PENDING]
            busy = {h.peer for h in pending}
            ready = [] if quiet() else [t for t in untold if t.peer_id not in busy]
            for target in ready:  # each once the writes into its own blocks ended
                untold.remove(target)
            self._tell_failed(ready, notice)
            if not pending or time.monotonic() >= deadline:
                return untold, pending
            time.sleep(0.002)  # (not ``wait``: each of its timeouts would count in the stats)

    def _keep_unsettled(self, tid: str, pending: list[TransferHandle]) -> None:
        """Keep transfer ``tid``'s writes still ``pending`` for its ``/cancel`` to ask after."""
        with self._lock:
            self._unsettled.pop(tid, None)
            if len(self._unsettled) >= MAX_OFFERS:  # the oldest's decode gave up long ago
                del self._unsettled[next(iter(self._unsettled))]
            self._unsettled[tid] = (time.monotonic(), pending)

    def _log_untold(self, untold: Sequence[_Target], tid: str) -> None:
        for target in untold:
            logger.error(
                "not telling decode TP rank %d that transfer %s failed: a write into its "
                "blocks is still pending after %.0fs (it fails at its own timeout)",
                target.layout.tp_rank,
                tid,
                self.cfg.transfer_timeout_s,
            )

    # ---- completions ----
    def _handle_notifications(self) -> None:
        assert self.transport is not None
        for n in self.transport.drain_notifications():
            try:
                body = json.loads(n.payload)
                op = body["op"]
            except (ValueError, KeyError, TypeError):
                logger.warning("ignored a malformed notification from %s", n.sender)
                continue
            if op in ("done", "renew"):
                req = str(body.get("req"))
                slot = _reader_slot(body) if op == "done" else None
                with self._lease_lock:
                    holders = self._leases.holders(req)
                    closes = slot is not None and self._leases.unclaimed(req, slot)
                    if holders and n.sender not in holders and not closes:
                        logger.warning(
                            "ignored %r for %s from %s: its blocks are leased to %s",
                            op,
                            req,
                            n.sender,
                            ", ".join(sorted(holders)),
                        )
                        continue
                    if op == "renew":
                        self._leases.renew(req)
                        continue
                    released = self._leases.done(req, n.sender, slot)
                if released:
                    self._free(req, "released", n.sender)
            elif op == "written":
                tid = str(body.get("transfer_id"))
                with self._lock:
                    writers = self._awaiting.get(tid)
                    if writers is not None and n.sender in writers:
                        computed = body.get("prompt_hash")
                        self._written[(tid, n.sender)] = (
                            bool(body.get("ok")),
                            str(body.get("error", "")),
                            computed if isinstance(computed, str) else None,
                        )
                        continue
                if writers is None:
                    logger.warning(
                        "ignored a 'written' notice from %s for no waiting load", n.sender
                    )
                else:
                    logger.warning(
                        "ignored a 'written' notice for transfer %s from %s: %s writes it",
                        tid,
                        n.sender,
                        ", ".join(sorted(writers)),
                    )

    def _free(self, req_id: str, outcome: str, peer: str | None = None) -> None:
        """The lease of ``req_id`` ended (``outcome``: released by ``peer``, or expired): no
        peer may read its blocks any more."""
        with self._lease_lock:  # the side channel adds grants under it (``_on_renew``)
            grants = self._read_grants.pop(req_id, ())
        for grant in grants:
            self._revoke(grant)
        blocks = self._held.pop(req_id, None)
        self._finished_sending.add(req_id)
        if self._hold_spans:
            traced = self._hold_spans.pop(req_id, None)
            if traced is not None:
                self.spans.record(
                    "kv_hold",
                    traced[0],
                    traced[1],
                    outcome=outcome,
                    error=LeaseExpired(f"no decode read the blocks of {req_id} in time")
                    if outcome == "expired"
                    else None,
                    mode=READ,
                    blocks=sum(len(g) for g in blocks) if blocks else None,
                    peer=peer,
                    request_id=req_id,
                )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose sends / loads ended since the last call (failed loads included)."""
        tracked = self._held.keys() | self._pushes.keys() | self._push_confirmed
        self._finished_reqs |= finished_req_ids & tracked
        if self.transport is not None:
            self._handle_notifications()
        with self._lease_lock:
            expired = self._leases.expired()
        if expired:
            for holder in expired.values():
                self.stats.lease_expired(holder)
            logger.warning(
                "freed the KV blocks of %d request(s) whose lease ran out: %s",
                len(expired),
                list(expired),
            )
        for req in expired:
            self._free(req, "expired")
        for req_id, fut in list(self._push_futures.items()):
            if fut.done():
                if fut.exception() is not None:
                    logger.warning("KV push of %s failed: %s", req_id, fut.exception())
                del self._push_futures[req_id]
                # a cancelled transfer stays recorded (``_prune_offers`` ages it out), so an
                # offer that comes after its push ended is refused too
                self._pushes.pop(req_id, None)
                if req_id in self._push_confirmed:
                    self._push_confirmed.discard(req_id)
                    self._finished_sending.add(req_id)
        self._prune_offers()
        recving = set()
        for req_id, fut in list(self._loads.items()):
            if not fut.done():
                continue
            del self._loads[req_id]
            blocks = self._load_blocks.pop(req_id, ())
            if fut.exception() is not None:
                if not isinstance(fut.exception(), KVRefused):  # logged (rate-limited) already
                    logger.warning("%s", fut.exception())
                if len(self.block_sizes) > 1:
                    # block ids repeat across groups: vLLM takes hybrid failures by request
                    self._failed_loads.add(req_id)
                else:
                    self._load_errors.update(blocks)
            recving.add(req_id)
        sending = self._finished_sending & self._finished_reqs
        self._finished_sending -= sending
        self._finished_reqs -= sending
        self._finished_reqs -= recving
        self.stats.blocks_held(sum(len(g) for ids in self._held.values() for g in ids))
        return (sending or None), (recving or None)

    def _prune_offers(self) -> None:
        """Forget decode offers no prefill request ever claimed (the prefill leg failed or
        went elsewhere): after two leases nobody can still be waiting for them."""
        horizon = time.monotonic() - 2 * self.cfg.lease_s
        with self._lock:
            stale = [
                t for t, o in self._targets.items() if min(x.received for x in o.values()) < horizon
            ]
            for tid in stale:
                del self._targets[tid]
                self._cancelled.pop(tid, None)
            for tid in [t for t, at in self._cancelled.items() if at < horizon]:
                del self._cancelled[tid]
            for tid in [t for t, (at, _) in self._unsettled.items() if at < horizon]:
                del self._unsettled[tid]

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of loads reported finished that did not complete (then cleared); one KV
        cache group only."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_failed_loads(self) -> set[str]:
        """Requests (hybrid models: several KV cache groups) whose load reported finished
        did not complete (then cleared)."""
        failed, self._failed_loads = self._failed_loads, set()
        return failed

    def shutdown(self) -> None:
        """Stop the handshake server, the transfer threads and the transport."""
        if self._server is not None:
            self._server.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.transport is not None:
            self.transport.close()


def _state_spans(
    local: CacheView, rank: int, remote: CacheView, remote_rank: int, pairs: Any
) -> np.ndarray:
    """The ``(local, remote, length)`` rows moving, for blocks ``pairs`` (local, remote), the
    parts of a Mamba2 state page that rank ``rank`` of ``local``'s engine takes from rank
    ``remote_rank`` of ``remote``'s (engines of different TP sizes; none: an empty array)."""
    if local.state is None or remote.state is None:
        raise LayoutMismatch(f"the state of {local.layers[0]} is not split by heads on one side")
    sources = source_ranks(rank, local.state.tp_size, remote.state.tp_size)
    try:
        page = state_page_spans(local.state, rank, remote.state, sources).get(remote_rank, [])
    except ValueError as e:
        raise LayoutMismatch(str(e)) from e
    return state_block_spans(local, remote, pairs, page)


def _failure(error: BaseException) -> str:
    """A failed transfer's span outcome."""
    return "refused" if isinstance(error, KVRefused) else "failed"


def _engine_key(remote: RemoteRef) -> str:
    """How a prefill engine's handshakes are keyed (its ranks' add ``#<rank>``)."""
    return f"{remote.engine_id}@{remote.host}:{remote.port}"


def _written_notice(
    transfer_id: str, ok: bool, error: str, prompt_hash: str | None
) -> dict[str, Any]:
    """The "written" notice a WRITE's prefill rank sends each decode rank it wrote (or
    failed to write): ``prompt_hash``, of the prompt it computed, is what the decode checks."""
    return {
        "op": "written",
        "transfer_id": transfer_id,
        "ok": ok,
        "error": error,
        "prompt_hash": prompt_hash,
    }


def _reader_slot(body: Mapping[str, Any]) -> tuple[str, int] | None:
    """The lease slot a "done" notice names (as ``_claim_slots`` keys it: decode engine, TP
    rank), or None when it names none (a decode of an earlier package)."""
    engine, rank = body.get("decode_engine"), body.get("tp_rank")
    if isinstance(engine, str) and isinstance(rank, int) and not isinstance(rank, bool):
        return engine, rank
    return None


def _read_grant(req_id: str) -> str:
    """Id of the grant that lets a lease's holder read the blocks of ``req_id``."""
    return f"read:{req_id}"


def _write_grant(transfer_id: str, rank: int) -> str:
    """Id of the grant that lets prefill rank ``rank`` write transfer ``transfer_id``'s
    blocks."""
    return f"write:{transfer_id}#{rank}"
