"""Serving one request: admission, decision, the prefill leg, the decode leg, the relay.

Text mode forwards OpenAI requests to the engines' OpenAI routes. Token mode (a render tier
configured, ``token_mode.py``) renders the request first, runs both legs on the engines'
``/inference/v1/generate`` and derenders the answer (per event when streaming); a client that
goes away also gets an explicit ``/inference/v1/abort_requests`` to the engines it reached.

Failure semantics (all timeouts come from ``TimeoutConfig``):

* prefill leg fails (unreachable, 5xx, timeout, no ``kv_transfer_params``): try up to
  ``prefill_retries`` other prefill instances, then serve colocated on the decode instance
  (``retry-then-colocated``, default) or answer 502 (``retry-then-fail``). Never a partial answer.
* decode leg fails before its first byte: try up to ``decode_retries`` other decode instances
  (colocated there when the protocol pushed the KV to the first one: ``binds_decode``).
* decode fails mid-stream: one SSE error event, then the stream closes.
* a 4xx from an engine is the client's mistake: passed through unchanged.
* the client disconnects: waiting for the prefill leg -> that request is cancelled (the engine
  aborts it and frees its KV); between the legs -> the prefill's KV is drained by a background
  one-token decode request, so the prefill instance frees it at once instead of at lease expiry;
  during the decode leg -> the decode request is cancelled (the engine aborts it; the prefill
  side frees any KV not yet pulled when its lease runs out).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from vllm_pd_ext.proxy.admission import Admission
from vllm_pd_ext.proxy.client_channel import (
    STREAM_END,
    ClientGone,
    DirectWriter,
    DisconnectWatch,
    RelayResponse,
)
from vllm_pd_ext.proxy.config import ProxyConfig
from vllm_pd_ext.proxy.decision import Decider, Decision
from vllm_pd_ext.proxy.errors import ProxyError, passthrough, sse_error
from vllm_pd_ext.proxy.fleet import Fleet, Instance
from vllm_pd_ext.proxy.metrics import ProxyMetrics
from vllm_pd_ext.proxy.policies import make_policy
from vllm_pd_ext.proxy.protocols import MissingCoordinates, make_protocol
from vllm_pd_ext.proxy.request import RequestContext, Route, parse_request, read_body
from vllm_pd_ext.proxy.token_mode import (
    ABORT_PATH,
    DerenderStream,
    RenderTier,
    TokenRequest,
    engine_request_id,
    generate_leg,
)
from vllm_pd_ext.proxy.upstream import Timeouts, UpstreamError, UpstreamResponse

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Fields the prefill leg drops or overrides; the decode leg sends the client's originals.
PREFILL_DROPPED = ("stream_options", "min_tokens")


class LegFailed(Exception):
    """Every instance tried for one leg failed with a server-side error."""


class _LegError(Exception):
    """One attempt at a leg failed in a way another instance may not."""


class _Slot:
    """One admission slot, released exactly once by whoever ends the request."""

    def __init__(self, admission: Admission):
        self._admission = admission
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._admission.release()


def prefill_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg (text mode): one token, not streamed, carrying the protocol's
    ``params``."""
    out = {k: v for k, v in body.items() if k not in PREFILL_DROPPED}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out["kv_transfer_params"] = dict(params)
    return out


def prefill_cached_tokens(
    params: dict[str, Any] | None, usage: dict[str, Any] | None
) -> int | None:
    """Prompt tokens the prefill instance found in its own prefix cache, when it says."""
    cached = (params or {}).get("remote_prefill_cached_tokens")
    if isinstance(cached, int):
        return cached
    details = (usage or {}).get("prompt_tokens_details") or {}
    value = details.get("cached_tokens")
    return value if isinstance(value, int) else None


def patch_payload(data: dict[str, Any], cached: int | None) -> dict[str, Any]:
    """Hide ``kv_transfer_params`` from the client; report the prefill side's cache hits.

    The decode instance counts the KV it received as cached; the client cares about what the
    prefill instance found in its prefix cache.
    """
    data.pop("kv_transfer_params", None)
    usage = data.get("usage")
    if cached is not None and isinstance(usage, dict):
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            details["cached_tokens"] = cached
    return data


class ProxyService:
    """The proxy's state and request path; one per app."""

    def __init__(self, config: ProxyConfig):
        self.config = config
        self.fleet = Fleet(config)
        self.metrics = ProxyMetrics()
        self.admission = Admission(
            config.max_in_flight,
            config.max_queued,
            config.queue_timeout_s,
            on_queued=self.metrics.queued.set,
        )
        self.decider = Decider(config.decision)
        self.prefill_policy = make_policy(config.prefill_policy)
        self.decode_policy = make_policy(config.decode_policy)
        self.protocol = make_protocol(config.protocol)
        self._tasks: set[asyncio.Task] = set()
        t = config.timeouts
        self._prefill_timeout = Timeouts(total=t.prefill_s, connect=t.connect_s).client()
        # Each wait for bytes (the headers, then every chunk) is bounded; a stream as a whole
        # is not.
        self._decode_timeout = Timeouts(
            connect=t.connect_s, read=max(t.decode_first_byte_s, t.decode_idle_s)
        ).client()
        self._drain_timeout = Timeouts(total=t.drain_s, connect=t.connect_s).client()
        self._abort_timeout = Timeouts(total=t.health_s, connect=t.connect_s).client()
        #: Token mode's render tier (created on the event loop in ``start``).
        self.render: RenderTier | None = None

    async def start(self) -> None:
        if self.config.render:
            t = self.config.timeouts
            self.render = RenderTier(
                self.config.render,
                timeout_s=t.render_s,
                connect_s=t.connect_s,
                max_connections=self.config.max_in_flight,
            )
        await self.fleet.start()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.fleet.close()
        if self.render is not None:
            await self.render.close()

    def _spawn(self, coro: Awaitable[None], name: str) -> None:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- entry point ---------------------------------------------------------------------

    async def handle(self, request: Request, route: Route) -> Response:
        """Serve one OpenAI request. Raises ``ProxyError`` for answers the app maps."""
        body, raw = await read_body(request, self.config.max_body_bytes)
        ctx = parse_request(route, body, request, self.config, raw)
        try:
            await self.admission.acquire()
        except ProxyError as exc:
            self.metrics.rejected.labels(exc.code or "saturated").inc()
            raise
        slot = _Slot(self.admission)
        self.metrics.in_flight.inc()
        handed_over = False
        watch = DisconnectWatch(request)
        try:
            response = await self._serve(watch, ctx, slot)
            handed_over = isinstance(response, RelayResponse)  # it releases slot and watch
            return response
        except ClientGone as gone:
            self.metrics.aborts.labels(gone.phase).inc()
            if ctx.tokens is not None and gone.phase != "between_legs":
                self._abort_engines(ctx)
            self._finished(ctx, gone.decision, f"client_gone_{gone.phase}", "client_gone")
            return Response(status_code=499)
        finally:
            if not handed_over:
                watch.stop()
                slot.release()
                self.metrics.in_flight.dec()

    async def _serve(self, watch: DisconnectWatch, ctx: RequestContext, slot: _Slot) -> Response:
        decode_pool = self.fleet.healthy("decode")
        if not decode_pool:
            raise ProxyError(
                503,
                "no healthy decode instance",
                code="no_upstream",
                retry_after=self.config.health_interval_s,
            )
        if self.render is not None:
            ctx.tokens = await watch.race(self._render(ctx), "render")
        decode = self.decode_policy.select(ctx.affinity_key, decode_pool)
        prefill_pool = [p for p in self.fleet.healthy("prefill") if p is not decode]
        decision = self.decider.decide(ctx, prefill_pool, decode)
        self.metrics.child(self.metrics.decisions, decision.label, decision.reason).inc()
        start = time.perf_counter()
        params: dict[str, Any] | None = None
        cached: int | None = None
        prefill_done: float | None = None
        pending: asyncio.Task | None = None
        if decision.split:
            try:
                if self.protocol.concurrent:
                    params, pending, usage = await self._split_concurrent(
                        watch, ctx, prefill_pool, decode
                    )
                else:
                    params, usage = await watch.race(
                        self._prefill_serial(ctx, prefill_pool, decode), "prefill"
                    )
            except LegFailed as exc:
                if self.config.on_prefill_failure == "retry-then-fail":
                    self._finished(ctx, "split", "prefill_failed")
                    raise ProxyError(502, f"prefill failed: {exc}", code="prefill_failed") from None
                self.metrics.fallbacks.labels("prefill_failed").inc()
                logger.warning(
                    "request %s: prefill failed (%s); serving colocated", ctx.request_id, exc
                )
                decision = Decision(False, "prefill_failed")
            else:
                prefill_done = time.perf_counter()
                self.metrics.prefill_leg.observe(prefill_done - start)
                cached = prefill_cached_tokens(params, usage)
                if watch.gone.is_set():
                    if pending is not None:  # the decode leg is in flight: it frees P's KV
                        await _discard(pending)
                    else:
                        self._spawn(self._drain(ctx, params, decode), f"drain-{ctx.request_id}")
                    raise ClientGone("between_legs")
        return await self._decode(
            watch,
            ctx,
            decode,
            decode_pool,
            decision,
            params,
            cached,
            start,
            prefill_done,
            slot,
            pending,
        )

    # -- legs ----------------------------------------------------------------------------

    async def _prefill_once(
        self, ctx: RequestContext, inst: Instance, params: dict[str, Any]
    ) -> tuple[dict[str, Any] | None, dict | None]:
        """One prefill attempt on ``inst``; its answer's kv_transfer_params and usage.

        Raises ``_LegError`` when another instance may do better, ``ProxyError`` for a 4xx.
        """
        inst.in_flight += 1
        try:
            if ctx.tokens is not None:
                ctx.engines.append(inst)
                body = generate_leg(ctx.tokens.generate, params, max_tokens=1)
            else:
                body = prefill_body(ctx.body, params)
            status, raw = await inst.client.fetch(
                "POST", ctx.path, self._prefill_timeout, body, {"X-Request-Id": ctx.request_id}
            )
        except UpstreamError as exc:
            self._upstream_failed(inst, exc)
            raise _LegError(f"{inst.label}: {exc.kind}") from None
        finally:
            inst.in_flight -= 1
        if 400 <= status < 500:
            raise passthrough(status, raw)
        if status != 200:
            raise _LegError(f"{inst.label}: HTTP {status}")
        data = _json_or_none(raw) or {}
        answer = data.get("kv_transfer_params")
        return (answer if isinstance(answer, dict) else None), data.get("usage")

    def _candidates(
        self,
        ctx: RequestContext,
        pool: list[Instance],
        leg: str,
        first: Instance | None = None,
    ) -> Iterator[Instance]:
        """Up to 1 + the leg's retries distinct healthy instances, ``first`` first; every
        instance after the first counts as a retry."""
        policy = self.prefill_policy if leg == "prefill" else self.decode_policy
        retries = self.config.prefill_retries if leg == "prefill" else self.config.decode_retries
        tried: list[Instance] = []
        for attempt in range(1 + retries):
            if attempt == 0 and first is not None:
                inst = first
            else:
                candidates = [p for p in pool if p not in tried and p.healthy]
                if not candidates:
                    return
                inst = policy.select(ctx.affinity_key, candidates)
                if attempt:
                    self.metrics.retries.labels(leg).inc()
            tried.append(inst)
            yield inst

    async def _prefill_serial(
        self, ctx: RequestContext, pool: list[Instance], decode: Instance
    ) -> tuple[dict[str, Any], dict | None]:
        """Serial protocols: the prefill leg; its kv_transfer_params feed the decode leg."""
        errors: list[str] = []
        for inst in self._candidates(ctx, pool, "prefill"):
            try:
                plan = self.protocol.plan(ctx.request_id, inst.config, decode.config)
            except MissingCoordinates as exc:
                errors.append(str(exc))
                continue
            try:
                answer, usage = await self._prefill_once(ctx, inst, plan.prefill_params)
            except _LegError as exc:
                errors.append(str(exc))
                continue
            if answer is None:
                errors.append(f"{inst.label}: no kv_transfer_params (is a KV connector set?)")
                continue
            return answer, usage
        raise LegFailed("; ".join(errors) or "no healthy prefill instance")

    async def _split_concurrent(
        self, watch: DisconnectWatch, ctx: RequestContext, pool: list[Instance], decode: Instance
    ) -> tuple[dict[str, Any], asyncio.Task, dict | None]:
        """Concurrent protocols: send the decode leg, then run the prefill leg beside it.

        Returns the decode leg's params, its pending response and the prefill's usage. If the
        prefill fails, the pending decode request is cancelled (the engine frees what it
        allocated) before the next prefill instance is tried.
        """
        errors: list[str] = []
        for inst in self._candidates(ctx, pool, "prefill"):
            try:
                plan = self.protocol.plan(ctx.request_id, inst.config, decode.config)
            except MissingCoordinates as exc:
                errors.append(str(exc))
                continue
            assert plan.decode_params is not None
            pending = asyncio.ensure_future(self._open_decode(decode, ctx, plan.decode_params))
            try:
                _, usage = await watch.race(
                    self._prefill_once(ctx, inst, plan.prefill_params), "prefill"
                )
            except _LegError as exc:
                await _discard(pending)
                errors.append(str(exc))
                continue
            except BaseException:
                await _discard(pending)
                raise
            return plan.decode_params, pending, usage
        raise LegFailed("; ".join(errors) or "no healthy prefill instance")

    @staticmethod
    def _stream_headers(ctx: RequestContext) -> list[tuple[bytes, bytes]]:
        return [
            (b"content-type", b"text/event-stream"),
            (b"x-request-id", ctx.request_id.encode("latin-1")),
        ]

    async def _open_decode(
        self,
        inst: Instance,
        ctx: RequestContext,
        params: dict[str, Any] | None,
        sink: Callable[[bytes], bool] | None = None,
    ) -> UpstreamResponse:
        """Send the decode leg to ``inst``; return the response with its body unread.
        ``sink``: the body's sink from the moment a 200 head arrives."""
        body: dict[str, Any] | bytes = ctx.engine_body
        if params is not None:
            body = {**ctx.engine_body, "kv_transfer_params": params}
        elif ctx.tokens is None and ctx.raw is not None:
            body = ctx.raw  # pass-through: the client's bytes, not encoded again
        if ctx.tokens is not None:
            ctx.engines.append(inst)
        return await inst.client.send(
            "POST",
            ctx.path,
            self._decode_timeout,
            body,
            {"X-Request-Id": ctx.request_id},
            sink_on_ok=sink,
        )

    async def _decode(
        self,
        watch: DisconnectWatch,
        ctx: RequestContext,
        first: Instance,
        pool: list[Instance],
        decision: Decision,
        params: dict | None,
        cached: int | None,
        start: float,
        prefill_done: float | None,
        slot: _Slot,
        pending: asyncio.Task | None = None,
    ) -> Response:
        """The decode leg, retried on other decode instances until its first byte.

        ``pending`` is a decode request already sent to ``first`` (concurrent protocols).
        When the protocol bound the KV to ``first``, a retry elsewhere runs colocated.
        """
        errors: list[str] = []
        headers = self._stream_headers(ctx) if ctx.stream else []
        for attempt, inst in enumerate(self._candidates(ctx, pool, "decode", first)):
            if attempt and params is not None and self.protocol.binds_decode:
                params, cached = None, None
                self.metrics.fallbacks.labels("decode_retry").inc()
            inst.in_flight += 1
            keep = False
            relay: _Relay | None = None
            try:
                try:
                    if attempt == 0 and pending is not None:
                        opening = pending
                    else:
                        sink = None
                        if ctx.stream and ctx.tokens is None:
                            # Pass-through streaming: the first events may go to the client
                            # from the engine connection as they come (the response started
                            # there), ahead of this task waking.
                            relay = _Relay(self, ctx, decision, cached, start, prefill_done)
                            writer = DirectWriter.before_start(watch, headers)
                            relay.writer = writer
                            sink = relay.sink if writer is not None else None
                        opening = self._open_decode(inst, ctx, params, sink)
                    try:
                        resp = await watch.race(opening, "decode_wait")
                    except ClientGone:
                        if relay is not None and relay.writer is not None and relay.writer.started:
                            # the stream was under way, from the engine connection's side
                            raise ClientGone("decode_stream", decision.label) from None
                        raise
                except UpstreamError as exc:
                    self._upstream_failed(inst, exc)
                    errors.append(f"{inst.label}: {exc.kind}")
                    continue
                if resp.status >= 500:
                    resp.close()
                    errors.append(f"{inst.label}: HTTP {resp.status}")
                    continue
                if resp.status != 200:
                    try:
                        raw = await watch.race(resp.read(), "decode")
                    except UpstreamError:
                        raw = b""
                    finally:
                        resp.close()
                    self._finished(
                        ctx, decision.label, f"client_error_{resp.status}", "client_error"
                    )
                    raise passthrough(resp.status, raw)
                if ctx.stream:
                    keep = True
                    if relay is None:
                        relay = _Relay(self, ctx, decision, cached, start, prefill_done)
                    return RelayResponse(
                        self._relay(resp, ctx, inst, decision, slot, relay),
                        watch,
                        headers,
                        direct=relay,
                    )
                try:
                    raw = await watch.race(resp.read(), "decode")
                except UpstreamError as exc:
                    self._upstream_failed(inst, exc)
                    raise ProxyError(
                        502, f"decode instance failed: {exc.kind}", code="decode_failed"
                    ) from None
                finally:
                    resp.close()
                data = json.loads(raw)
                if isinstance(data, dict):
                    if ctx.tokens is not None:
                        data = await watch.race(self._derender(ctx, data), "decode")
                    patch_payload(data, cached)
                self._finished(ctx, decision.label, f"ok via {inst.label}", "ok")
                return JSONResponse(data, headers={"X-Request-Id": ctx.request_id})
            finally:
                if not keep:
                    inst.in_flight -= 1
        self._finished(ctx, decision.label, "decode_failed")
        raise ProxyError(502, "decode failed: " + "; ".join(errors), code="decode_failed")

    async def _relay(
        self,
        resp: UpstreamResponse,
        ctx: RequestContext,
        inst: Instance,
        decision: Decision,
        slot: _Slot,
        relay: _Relay,
    ) -> AsyncIterator[bytes]:
        """Forward the decode stream; measure TTFT, ITL and the transfer gap (``_Relay``).

        In text mode, once the response's head is out, ``relay`` takes the engine's bytes as
        they are parsed and writes its events to the client itself (``DirectWriter``); what
        it leaves (the last event, anything while the client's buffer is full, the end of
        the stream or a break in it) comes through here, in order.
        """
        outcome = "ok"
        derender = None
        if ctx.tokens is not None:
            assert self.render is not None
            derender = DerenderStream(self.render, ctx.route, ctx.body, ctx.tokens, ctx.request_id)
        else:
            resp.set_sink(relay.sink)
        try:
            async for chunk in resp.chunks():
                now = time.perf_counter()
                if derender is None:
                    ready = relay.events(chunk, now)
                    if ready is None:
                        continue
                else:
                    ready = relay.split(chunk)
                    if ready is None:
                        continue
                    ready = await derender.feed(ready)
                    relay.observe(ready, now)
                yield ready
            if relay.buffer.strip():
                yield relay.buffer
        except UpstreamError as exc:
            outcome = "decode_failed_mid_stream"
            self._upstream_failed(inst, exc)
            logger.warning(
                "request %s: decode stream from %s failed: %s", ctx.request_id, inst.label, exc
            )
            yield sse_error(502, f"decode instance failed mid-stream: {exc.kind}")
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "client_gone"
            self.metrics.aborts.labels("decode_stream").inc()
            logger.info("request %s: client disconnected while streaming", ctx.request_id)
            if ctx.tokens is not None:
                self._abort_engines(ctx)
            raise
        finally:
            resp.close()
            relay.writer = None
            inst.in_flight -= 1
            slot.release()
            self.metrics.in_flight.dec()
            self._finished(ctx, decision.label, f"{outcome} via {inst.label}", outcome)

    def _finished(
        self, ctx: RequestContext, decision: str, detail: str, outcome: str | None = None
    ) -> None:
        """Count the request's outcome and write its one INFO line."""
        outcome = outcome or detail
        self.metrics.child(self.metrics.requests, ctx.route, decision, outcome).inc()
        logger.info(
            "request %s %s %s: %s (%.0f ms)",
            ctx.request_id,
            ctx.route,
            decision,
            detail,
            (time.perf_counter() - ctx.received) * 1e3,
        )

    def _observe_first(
        self,
        ctx: RequestContext,
        decision: Decision,
        start: float,
        prefill_done: float | None,
        now: float,
    ) -> None:
        self.metrics.child(self.metrics.ttft, ctx.route, decision.label).observe(now - start)
        if prefill_done is not None:
            gap = now - prefill_done
            self.metrics.transfer_gap.observe(gap)
            self.decider.observe(ctx.est_prompt_tokens, prefill_done - start, gap)

    async def _drain(self, ctx: RequestContext, params: dict[str, Any], decode: Instance) -> None:
        """Let a decode instance pull an abandoned prefill's KV so the prefill frees it now."""
        if ctx.tokens is not None:
            body = generate_leg(ctx.tokens.generate, params, max_tokens=1)
        else:
            body = {**ctx.body, "kv_transfer_params": params, "max_tokens": 1, "stream": False}
            body.pop("stream_options", None)
            if "max_completion_tokens" in body:
                body["max_completion_tokens"] = 1
        outcome = "ok"
        try:
            status, _ = await decode.client.fetch(
                "POST",
                ctx.path,
                self._drain_timeout,
                body,
                {"X-Request-Id": f"{ctx.request_id}-drain"},
            )
            if status != 200:
                outcome = f"http_{status}"
        except UpstreamError as exc:
            outcome = exc.kind
        self.metrics.drains.labels(outcome).inc()
        logger.info("request %s: drained abandoned prefill KV (%s)", ctx.request_id, outcome)

    # -- token mode ----------------------------------------------------------------------

    async def _render(self, ctx: RequestContext) -> TokenRequest:
        """Render the client's request; the prompt's exact length replaces the estimate."""
        assert self.render is not None
        started = time.perf_counter()
        tokens = await self.render.render(ctx.route, ctx.body, ctx.request_id, ctx.stream)
        ctx.est_prompt_tokens = len(tokens.prompt_ids)
        logger.debug(
            "request %s: rendered %d prompt tokens in %.1f ms",
            ctx.request_id,
            len(tokens.prompt_ids),
            (time.perf_counter() - started) * 1e3,
        )
        return tokens

    async def _derender(self, ctx: RequestContext, data: dict[str, Any]) -> dict[str, Any]:
        assert self.render is not None and ctx.tokens is not None
        return await self.render.derender(ctx.route, ctx.body, ctx.tokens, data, ctx.request_id)

    def _abort_engines(self, ctx: RequestContext) -> None:
        """Token mode: tell every engine the request reached to abort it (closing the
        connection aborts it too; this also reaches an engine whose answer is buffered)."""
        for inst in dict.fromkeys(ctx.engines):
            self._spawn(self._abort(inst, ctx.request_id), f"abort-{ctx.request_id}")

    async def _abort(self, inst: Instance, request_id: str) -> None:
        body = {"request_ids": [engine_request_id(request_id)]}
        try:
            status, _ = await inst.client.fetch("POST", ABORT_PATH, self._abort_timeout, body)
            outcome = str(status)
        except UpstreamError as exc:
            outcome = exc.kind
        logger.info("request %s: abort sent to %s (%s)", request_id, inst.label, outcome)

    # -- helpers -------------------------------------------------------------------------

    def _upstream_failed(self, inst: Instance, exc: UpstreamError) -> None:
        """Take ``inst`` out of rotation when the failure says it is gone (not on timeouts)."""
        if exc.down:
            inst.mark_failed(str(exc), self.config.health_backoff_max_s)
        logger.warning("upstream %s failed: %s", inst.label, exc)


class _Relay:
    """One stream's events on their way to the client, and the timings taken from them.

    ``events`` turns the engine's bytes into complete SSE events (a trailing partial event
    waits in ``buffer`` for its end; events that arrived together leave together, fewer
    writes under load), hides ``kv_transfer_params``, reports the prefill's cache hits, and
    observes the first token and the gaps between arrivals. ``sink`` does the same from the
    upstream connection's ``data_received`` and writes the events to the client with
    ``writer`` (set by ``RelayResponse``), no task woken, when it may.
    """

    __slots__ = (
        "buffer",
        "cached",
        "ctx",
        "decision",
        "first",
        "itl",
        "last",
        "prefill_done",
        "service",
        "start",
        "writer",
    )

    def __init__(
        self,
        service: ProxyService,
        ctx: RequestContext,
        decision: Decision,
        cached: int | None,
        start: float,
        prefill_done: float | None,
    ):
        self.service = service
        self.ctx = ctx
        self.decision = decision
        self.cached = cached
        self.start = start
        self.prefill_done = prefill_done
        self.itl = service.metrics.child(service.metrics.itl, decision.label)
        self.buffer = b""
        self.first: float | None = None
        self.last = 0.0
        self.writer: DirectWriter | None = None

    def split(self, chunk: bytes) -> bytes | None:
        """The complete events ``chunk`` ends (None: none yet), as the engine sent them."""
        buffer = self.buffer + chunk if self.buffer else chunk
        end = buffer.rfind(b"\n\n") + 2
        if end < 2:
            self.buffer = buffer
            return None
        if end == len(buffer):
            self.buffer = b""
            return buffer
        self.buffer = buffer[end:]
        return buffer[:end]

    def events(self, chunk: bytes, now: float) -> bytes | None:
        """Text mode: the complete events ``chunk`` ends (None: none yet), as the client
        gets them; their arrival at ``now`` observed."""
        ready = self.split(chunk)
        if ready is None:
            return None
        cached = self.cached
        if b'"kv_transfer_params"' in ready or (
            cached is not None and b'"prompt_tokens_details"' in ready
        ):
            ready = b"".join(
                _patch_event(event, cached) + b"\n\n" for event in ready[:-2].split(b"\n\n")
            )
        self.observe(ready, now)
        return ready

    def observe(self, ready: bytes, now: float) -> None:
        """Events going to the client at ``now``: the first token, or the gap since the
        last events."""
        if self.first is None:
            if ready.startswith(b"data: {") or b"\n\ndata: {" in ready:
                self.first = now
                self.service._observe_first(
                    self.ctx, self.decision, self.start, self.prefill_done, now
                )
        else:
            self.itl.observe(now - self.last)
        self.last = now

    def sink(self, chunk: bytes) -> bool:
        """``UpstreamResponse.set_sink``'s sink: True when ``chunk`` was taken (its events,
        if any, written to the client). The end of the stream is left to the relay task, so
        that it leaves with the end of the response in one write."""
        writer = self.writer
        if writer is None or not writer.ready():
            return False
        if (self.buffer + chunk if self.buffer else chunk).endswith(STREAM_END):
            return False
        ready = self.events(chunk, time.perf_counter())
        if ready is not None:
            writer.write(ready)
        return True


async def _discard(task: asyncio.Task) -> None:
    """Cancel a pending upstream request, closing its response if it already arrived."""
    task.cancel()
    with contextlib.suppress(BaseException):
        resp = await task
        resp.close()


def _json_or_none(raw: bytes) -> dict | None:
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def _patch_event(event: bytes, cached: int | None) -> bytes:
    if not event.startswith(b"data: {"):
        return event
    try:
        data = json.loads(event[6:])
    except ValueError:
        return event
    return b"data: " + json.dumps(patch_payload(data, cached)).encode()
