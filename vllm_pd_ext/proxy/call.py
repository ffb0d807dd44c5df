"""One client request in flight: the state the stages share, and what it holds.

A ``Call`` is made once a request is admitted and lives until its last byte is written. It
owns:

* what the stages decided and measured: the decision, the decode leg's
  ``kv_transfer_params`` and the prefill side's cache hits, the leg timings;
* what the request holds: its admission slot, the in-flight leases of the instances serving
  it, the KV room it reserved on its decode instance, a hedge's colocated leg, the
  disconnect watch, the proxy's in-flight gauge. ``close()`` gives all of it back,
  once, whoever ends the request (the orchestrator, or the relay of a streamed answer);
* its outcome: ``finish()`` counts it and writes the request's one INFO line, once.

States: admitted -> decided (``decision`` set) -> [prefilled (``prefill_done`` set)] ->
answering (a decode instance's lease held) -> finished -> closed. A request can finish from
any state (client gone, an error); ``close()`` always follows.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_pd_ext.proxy.admission import Admission
    from vllm_pd_ext.proxy.client_channel import DisconnectWatch
    from vllm_pd_ext.proxy.decision import Decision
    from vllm_pd_ext.proxy.fleet import Instance, Lease
    from vllm_pd_ext.proxy.hedge import Hedge
    from vllm_pd_ext.proxy.metrics import ProxyMetrics
    from vllm_pd_ext.proxy.migration import Migration, TokenMigration
    from vllm_pd_ext.proxy.request import RequestContext
    from vllm_pd_ext.proxy.tracing import RequestTrace

logger = logging.getLogger(__name__)


class Call:
    """See the module docstring. Used from the proxy's event loop only."""

    __slots__ = (
        "_admission",
        "_closed",
        "_leases",
        "_metrics",
        "_reserved",
        "cached",
        "ctx",
        "decision",
        "decode_instance",
        "engines",
        "hedge",
        "kv_first",
        "label",
        "migration",
        "outcome",
        "params",
        "prefill_done",
        "prefill_instance",
        "start",
        "trace",
        "watch",
    )

    def __init__(
        self,
        ctx: RequestContext,
        watch: DisconnectWatch,
        admission: Admission,
        metrics: ProxyMetrics,
    ):
        self.ctx = ctx
        self.watch = watch
        self._admission: Admission | None = admission  # its slot, already acquired
        self._metrics = metrics
        self._leases: list[Lease] = []
        self._reserved: tuple[Instance, int] | None = None
        self._closed = False
        self.decision: Decision | None = None
        #: The decision's metric label ("-" before one is made).
        self.label = "-"
        #: The decode leg's ``kv_transfer_params`` (None: the decode leg runs colocated).
        self.params: dict[str, Any] | None = None
        #: Prompt tokens the prefill instance found in its own prefix cache, when it said.
        self.cached: int | None = None
        #: When the legs started (after render and the decision), and the prefill leg ended.
        self.start = 0.0
        self.prefill_done: float | None = None
        #: The prefill instance that computed the KV the decode leg loads.
        self.prefill_instance: Instance | None = None
        #: The decode instance the latest decode attempt went to.
        self.decode_instance: Instance | None = None
        #: The decode leg's first step only loads the KV and answers one token (a guarded
        #: non-streamed split; the answer comes in a second step).
        self.kv_first = False
        #: The colocated leg started beside a late split (``hedge.py``), once started.
        self.hedge: Hedge | None = None
        #: Token mode: every engine the request was sent to (aborted if the client leaves).
        self.engines: list[Instance] = []
        #: A stream that can be continued elsewhere should its engine fail (migration.py).
        self.migration: Migration | TokenMigration | None = None
        self.outcome: str | None = None
        #: The request's trace (``tracing.py``); None when tracing is off.
        self.trace: RequestTrace | None = None
        metrics.in_flight.inc()

    def decide(self, decision: Decision) -> None:
        """The request is served as ``decision`` says (made, or changed by a fallback)."""
        self.decision = decision
        self.label = decision.label
        if self.trace is not None:
            self.trace.decided(decision)

    def split_failed(self) -> None:
        """A leg of the split failed or missed its deadline (counted as that): a hedge beside
        it now serves as its rescue."""
        if self.hedge is not None:
            self.hedge.rescue = True

    def colocate(self) -> None:
        """From now on the decode leg runs without KV from a prefill."""
        self.unreserve()
        self.params = self.cached = None
        self.prefill_done = self.prefill_instance = None

    def reserve(self, inst: Instance, blocks: int) -> None:
        """Count ``blocks`` of KV as taken on ``inst`` until they land (``landed()``) or the
        call closes, so that splits routed before its next scrape see them."""
        self.unreserve()
        inst.reserved_blocks += blocks
        self._reserved = (inst, blocks)

    def landed(self) -> None:
        """The reserved KV is on the decode instance: its next scrape's usage shows it."""
        reserved, self._reserved = self._reserved, None
        if reserved is not None:
            inst, blocks = reserved
            inst.reserved_blocks -= blocks
            inst.landed_blocks += blocks

    def unreserve(self) -> None:
        """The reserved KV will not land (the request went colocated, failed or ended)."""
        reserved, self._reserved = self._reserved, None
        if reserved is not None:
            reserved[0].reserved_blocks -= reserved[1]

    def hold(self, lease: Lease) -> None:
        """Keep ``lease`` until the call is closed (the block that took it lets it go)."""
        lease.kept = True
        self._leases.append(lease)

    def finish(self, outcome: str, detail: str | None = None) -> None:
        """Count the request's outcome and write its one INFO line (the first call only)."""
        if self.outcome is not None:
            return
        self.outcome = outcome
        ctx = self.ctx
        label = self.label
        metrics = self._metrics
        metrics.child(metrics.requests, ctx.route, label, outcome).inc()
        if self.trace is not None:
            self.trace.finished(outcome, detail)
        if logger.isEnabledFor(logging.INFO):  # its arguments are not free either
            logger.info(
                "request %s %s %s: %s (%.0f ms)%s",
                ctx.request_id,
                ctx.route,
                label,
                detail or outcome,
                (time.perf_counter() - ctx.received) * 1e3,
                f" client id {ctx.client_request_id!r}" if ctx.client_request_id else "",
            )

    def close(self) -> None:
        """Give back everything the request holds (once; later calls do nothing)."""
        if self._closed:
            return
        self._closed = True
        if self.hedge is not None:  # (one the request left running: closed)
            self.hedge.cancel("abandoned")
        self.unreserve()
        self.watch.stop()
        for lease in self._leases:
            lease.release()
        self._leases.clear()
        admission, self._admission = self._admission, None
        if admission is not None:
            admission.release()
        self._metrics.in_flight.dec()
        if self.trace is not None:
            self.trace.end()
