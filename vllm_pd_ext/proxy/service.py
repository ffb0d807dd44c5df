"""Serving one request, stage by stage; this module only puts the stages in order.

    [refused from its head when admission is full (app.py)] -> body read within the client
      limits (app.py, front_protocol.py, client_limits.py) -> parse and check (request.py)
      -> admit (admission.py) -> [render (token_mode.py)]
      -> route and decide (routing.py, decision.py) -> [prefill leg (prefill.py)]
      -> decode leg (decode.py) -> relay the answer (relay.py) [derender]

(token mode, a completion with several prompts: route -> batch.py, which sends and answers
them together).

The request's state lives in a ``Call`` (call.py), which also holds what the request holds
(admission slot, instance leases) and gives it back once, on every path. Work a request leaves
behind when its client goes (drains, aborts) runs in ``background.py``.

Text mode forwards OpenAI requests to the engines' OpenAI routes. Token mode (a render tier
configured) renders the request first, runs both legs on the engines'
``/inference/v1/generate`` and derenders the answer (streamed: one long-lived call, or one
call per event).

Failure semantics (all timeouts come from ``TimeoutConfig``):

* prefill leg fails (unreachable, 5xx, timeout, no ``kv_transfer_params``): try up to
  ``prefill_retries`` other prefill instances, then serve colocated on the decode instance
  (``retry-then-colocated``, default) or answer 502 (``retry-then-fail``). Never a partial answer.
* decode leg fails before its first byte: try up to ``decode_retries`` other decode instances
  (colocated there when the protocol pushed the KV to the first one: ``binds_decode``).
* a split stream's first token misses the stall guard's deadline (``stall_guard.py``): the
  decode leg is closed and the request served colocated, before the client saw a byte.
* a split stream that is late (``hedge`` on): the request is started colocated beside it
  (``hedge.py``) and the first of the two to answer serves it; the other is closed.
* decode fails mid-stream: the stream is continued on another instance where it broke
  (``migration.py``, up to ``max_migrations``); when none can, one SSE error event, then
  the stream closes. A whole answer that breaks after its head is asked again elsewhere.
* a 4xx from an engine is the client's mistake: passed through unchanged.
* the client disconnects: waiting for the prefill leg -> that request is cancelled (the engine
  aborts it and frees its KV); between the legs -> the prefill's KV is drained by a background
  one-token decode request, so the prefill instance frees it at once instead of at lease expiry;
  during the decode leg -> the decode request is cancelled (the engine aborts it; the prefill
  side frees any KV not yet pulled when its lease runs out).
"""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi.responses import Response

from vllm_pd_ext import fleet_key
from vllm_pd_ext.proxy.admission import Admission
from vllm_pd_ext.proxy.background import Background
from vllm_pd_ext.proxy.batch import Batch
from vllm_pd_ext.proxy.call import Call
from vllm_pd_ext.proxy.client_channel import ClientGone, DisconnectWatch, RelayResponse
from vllm_pd_ext.proxy.config import ProxyConfig
from vllm_pd_ext.proxy.decision import Decision
from vllm_pd_ext.proxy.decode import DecodeLeg
from vllm_pd_ext.proxy.errors import ProxyError
from vllm_pd_ext.proxy.fleet import Fleet
from vllm_pd_ext.proxy.hedge import HedgeWon
from vllm_pd_ext.proxy.metrics import ProxyMetrics
from vllm_pd_ext.proxy.migration import Migrator
from vllm_pd_ext.proxy.prefill import LegFailed, PrefillLeg
from vllm_pd_ext.proxy.protocols import SIGNED_DECODE_PARAMS, make_protocol
from vllm_pd_ext.proxy.relay import Relay, StreamRelay
from vllm_pd_ext.proxy.request import ClientRequest, Route, header, parse_body, parse_request
from vllm_pd_ext.proxy.routing import Router
from vllm_pd_ext.proxy.token_mode import RenderTier
from vllm_pd_ext.proxy.tracing import Tracing
from vllm_pd_ext.proxy.upstream import Timeouts, discard
from vllm_pd_ext.util.logs import bind_request

logger = logging.getLogger(__name__)


class ProxyService:
    """The proxy's stages and shared state; one per app. ``fast_path``: the server is
    ``front_protocol``'s, whose request cycle the stages may use directly. ``tracing``:
    where spans go, instead of the config's ``otlp_traces_endpoint`` (tests)."""

    def __init__(
        self, config: ProxyConfig, *, fast_path: bool = False, tracing: Tracing | None = None
    ):
        self.config = config
        self.fast_path = fast_path
        if tracing is None and config.otlp_traces_endpoint:
            tracing = Tracing.to_endpoint(config.otlp_traces_endpoint)
        #: None: tracing is off (the default).
        self.tracing = tracing
        self.fleet = Fleet(config)
        self.metrics = metrics = ProxyMetrics()
        self.admission = Admission(
            config.max_in_flight,
            config.max_queued,
            config.queue_timeout_s,
            on_queued=metrics.queued.set,
        )
        self.router = Router(config, self.fleet, metrics)
        key = fleet_key.load_key()
        if key is None and config.protocol in SIGNED_DECODE_PARAMS:
            logger.warning(
                "no fleet key (%s / %s): %s decode params go unsigned, and decode engines "
                "that hold a key will compute those prompts themselves",
                fleet_key.KEY_FILE_ENV,
                fleet_key.KEY_ENV,
                config.protocol,
            )
        protocol = make_protocol(config.protocol, key)
        t = config.timeouts
        self.background = Background(
            config.max_in_flight,
            metrics,
            drain_timeout=Timeouts(total=t.drain_s, connect=t.connect_s),
            abort_timeout=Timeouts(total=t.health_s, connect=t.connect_s),
        )
        # Each wait for the decode leg's bytes (the head, then every chunk) is bounded; a
        # stream as a whole is not.
        decode_timeout = Timeouts(
            connect=t.connect_s, read=max(t.decode_first_byte_s, t.decode_idle_s)
        )
        self.decode = DecodeLeg(protocol, self.router, self.fleet, metrics, decode_timeout)
        self.migrator = Migrator(config.max_migrations, self.fleet, metrics, decode_timeout)
        self.prefill = PrefillLeg(
            protocol,
            self.router,
            self.fleet,
            Timeouts(total=t.prefill_s, connect=t.connect_s),
            send_decode=self.decode.send,
            send_hedge=self.decode.send_hedge,
            # a late prefill leg's hedge serves colocated: not where a failed one must fail
            hedge=config.on_prefill_failure == "retry-then-colocated",
        )
        self.relay = Relay(
            self.fleet,
            metrics,
            self.router.decider,
            self.background,
            render=lambda: self.render,
            fast_path=fast_path,
            migrator=self.migrator,
        )
        self.batch = Batch(self.decode, self.relay, self.router, self.fleet)
        #: Token mode's render tier (created on the event loop in ``start``).
        self.render: RenderTier | None = None
        #: The event loop the service runs on (set in ``start``).
        self.loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        if self.config.render:
            t = self.config.timeouts
            self.render = RenderTier(
                self.config.render,
                timeout_s=t.render_s,
                connect_s=t.connect_s,
                max_connections=self.config.max_in_flight,
                api_key=(
                    self.config.render_api_key.get_secret_value()
                    if self.config.render_api_key
                    else None
                ),
                per_event=lambda reason: self.metrics.derender_per_event.labels(reason).inc(),
            )
        await self.fleet.start()

    async def close(self) -> None:
        await self.background.close()
        await self.fleet.close()
        if self.render is not None:
            await self.render.close()
        if self.router.tokenizer is not None:
            self.router.tokenizer.close()
        if self.tracing is not None:
            self.tracing.shutdown()

    def refusal_now(self) -> ProxyError | None:
        """The 429 a completion request gets from its head alone when admission is full
        (counted as rejected), else None. Asked before its body is read."""
        refused = self.admission.refusal_now()
        if refused is not None:
            self.metrics.rejected.labels(refused.code or "saturated").inc()
        return refused

    async def handle(
        self, request: ClientRequest, route: Route, raw: bytes
    ) -> Response | RelayResponse:
        """Serve one OpenAI request whose body ``raw`` the front door read within the client
        limits. Raises ``ProxyError`` for answers the app maps."""
        body = parse_body(raw, self.config.max_body_bytes)
        ctx = parse_request(route, body, request, self.config, raw)
        bind_request(ctx.request_id)  # this task's log lines name the request
        try:
            await self.admission.acquire()
        except ProxyError as exc:
            self.metrics.rejected.labels(exc.code or "saturated").inc()
            raise
        call = Call(
            ctx,
            DisconnectWatch(request, hooked=self.fast_path, loop=self.loop),
            self.admission,
            self.metrics,
        )
        if self.tracing is not None:
            call.trace = self.tracing.start(ctx, header(request, b"traceparent"))
        streaming = False
        try:
            response = await self._serve(call)
            streaming = isinstance(response, RelayResponse)  # it ends the call
            return response
        except ClientGone as gone:
            self.metrics.aborts.labels(gone.phase).inc()
            if ctx.tokens is not None and gone.phase != "between_legs":
                self.background.abort_engines(call)
            call.finish("client_gone", f"client_gone_{gone.phase}")
            return Response(status_code=499)
        except ProxyError as exc:
            call.finish(exc.outcome, f"{exc.outcome}: HTTP {exc.status}")
            raise
        except BaseException:
            call.finish("error")
            raise
        finally:
            if not streaming:
                call.close()

    async def _serve(self, call: Call) -> Response | RelayResponse:
        ctx = call.ctx
        decode_pool = self.router.decode_pool()
        if self.render is not None:
            span = call.trace.child("render") if call.trace is not None else None
            ctx.tokens = await call.watch.race(self.render.render_request(ctx), "render")
            if call.trace is not None:
                call.trace.done(span, prompt_tokens=len(ctx.tokens.prompt_ids))
        elif self.router.tokenizer is not None:  # text mode: the prompt's ids for lookups
            await call.watch.race(self.router.tokenize(ctx), "render")
        call.migration = self.migrator.prepare(ctx)  # before any leg is sent
        route = self.router.route(ctx, decode_pool)
        if route.waits:  # a split its decode instance has no KV room for yet
            route = await call.watch.race(self.router.room(ctx, route), "room")
        call.decide(route.decision)
        need = route.decision.inputs.get("kv_blocks_needed")
        if need is not None and route.decision.split:
            call.reserve(route.decode, need)
        call.start = time.perf_counter()
        if ctx.tokens is not None and ctx.tokens.more:  # several prompts: never split
            assert self.render is not None
            return await self.batch.serve(call, route, self.render)
        pending = None
        if route.decision.split:
            try:
                prefilled = await self.prefill.run(call, route)
            except HedgeWon:  # served by its colocated leg (decode.open takes it)
                call.decide(Decision(False, "hedge"))
            except LegFailed as exc:
                if self.config.on_prefill_failure == "retry-then-fail":
                    raise ProxyError(502, f"prefill failed: {exc}", code="prefill_failed") from None
                self.metrics.fallbacks.labels("prefill_failed").inc()
                logger.warning(
                    "request %s: prefill failed (%s); serving colocated", ctx.request_id, exc
                )
                call.decide(Decision(False, "prefill_failed"))
            else:
                call.prefill_done = time.perf_counter()
                self.metrics.prefill_leg.observe(call.prefill_done - call.start)
                call.params, call.cached = prefilled.params, prefilled.cached
                call.prefill_instance = prefilled.instance
                pending = prefilled.pending
                if call.watch.gone.is_set():
                    if pending is not None:  # the decode leg is in flight: it frees P's KV
                        await discard(pending)
                    else:
                        self.background.drain(call, route.decode)
                    raise ClientGone("between_legs")
        # a stream's state is made before the decode leg is sent: in text mode its events
        # may flow from the engine connection as soon as it answers
        stream = StreamRelay(self.relay, call) if ctx.stream else None
        opened = await self.decode.open(call, route, pending, stream)
        if stream is not None:
            return self.relay.stream(call, opened, stream)
        return await self.relay.whole(call, opened)
