"""The decode leg: the request sent to a decode instance, retried elsewhere until it answers.

The leg goes to the route's decode instance first (a concurrent protocol's prefill stage has
already sent it there: ``pending``). An attempt that fails before the answer's head
(unreachable, 5xx, timeout) is retried on another decode instance, up to ``decode_retries``;
when the protocol bound the KV to the first instance (``binds_decode``), a retry elsewhere
runs colocated. A 4xx is the client's mistake and passes through. Once an engine answers 200,
its lease stays with the call until the answer is out.

A split streamed leg is guarded (``stall_guard.py``): its first token must come within the
guard's deadline after the prefill leg, else it is closed and the request served colocated.
No colocated leg that follows waits unbounded on an instance that may be wedged (a suspect):

* after a stall, the stream's colocated leg on the instance ``stalled_on`` names (the prefill
  instance that just computed the prompt, or the decode that stalled) has a deadline too;
* a stream routed colocated because the breakers of its decode instance are open for that
  decode's own stalls (``breaker_open``, ``StallGuard.wedged``; not when only a prefill
  stalled) has a deadline on that instance;

past it the leg is closed, counted (``vllm_pd_fallbacks_total{reason="colocated_stall"}``) and
the next instance tried. The instances tried after a suspect are the pool's others: the
stalled prefill and decode, or the broken decode, come again only when no other is healthy
(a stalled split whose prefill instance is down meanwhile goes to another decode first).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from vllm_pd_ext.proxy.call import Call
from vllm_pd_ext.proxy.client_channel import ClientGone
from vllm_pd_ext.proxy.decision import Decision
from vllm_pd_ext.proxy.errors import ProxyError, passthrough
from vllm_pd_ext.proxy.fleet import Fleet, Instance, Lease
from vllm_pd_ext.proxy.hedge import Hedge, first_bytes, race
from vllm_pd_ext.proxy.legs import decode_body, one_token_body
from vllm_pd_ext.proxy.metrics import ProxyMetrics
from vllm_pd_ext.proxy.protocols import PDProtocol
from vllm_pd_ext.proxy.relay import Opened, StreamRelay, record_transfer
from vllm_pd_ext.proxy.routing import Route, Router
from vllm_pd_ext.proxy.upstream import Timeouts, UpstreamError, UpstreamResponse


class DecodeLeg:
    def __init__(
        self,
        protocol: PDProtocol,
        router: Router,
        fleet: Fleet,
        metrics: ProxyMetrics,
        timeout: Timeouts,
    ):
        self.protocol = protocol
        self.router = router
        self.fleet = fleet
        self.metrics = metrics
        self.timeout = timeout

    async def send(
        self,
        call: Call,
        inst: Instance,
        params: dict[str, Any] | None,
        sink: Callable[[bytes], bool] | None = None,
    ) -> UpstreamResponse:
        """Send the decode leg to ``inst``; the response with its body unread. ``sink``:
        the body's sink from the moment a 200 head arrives."""
        body = self._body(call, inst, params, first=True)
        return await self.send_body(call, inst, body, call.ctx.request_id, sink)

    def _body(
        self, call: Call, inst: Instance, params: dict[str, Any] | None, first: bool
    ) -> dict[str, Any] | bytes:
        """The decode leg's body for ``inst``. The ``first`` attempt of a guarded
        non-streamed split sends the one-token leg (its answer is the first token:
        ``stall_guard.py``), if ``inst`` keeps prompts in its prefix cache for the second
        step (``call.kv_first`` says which was sent)."""
        ctx = call.ctx
        call.kv_first = (
            first
            and params is not None
            and not ctx.stream
            and self.router.guard.guards(False, inst)
        )
        if call.kv_first:
            assert params is not None
            return one_token_body(ctx, params)
        return decode_body(ctx, params)

    async def send_body(
        self,
        call: Call,
        inst: Instance,
        body: dict[str, Any] | bytes,
        request_id: str,
        sink: Callable[[bytes], bool] | None = None,
    ) -> UpstreamResponse:
        """Send ``body`` to ``inst`` on the request's engine route as ``request_id``."""
        if call.ctx.tokens is not None and inst not in call.engines:
            call.engines.append(inst)
        call.decode_instance = inst
        headers = {"X-Request-Id": request_id}
        if call.trace is not None:  # tracing: this attempt's span and its traceparent
            call.trace.leg("decode", inst, headers)
        return await inst.client.send(
            "POST",
            call.ctx.path,
            self.timeout,
            body,
            headers,
            sink_on_ok=sink,
        )

    async def send_hedge(self, call: Call, inst: Instance) -> UpstreamResponse:
        """A hedge's colocated leg on ``inst``, under its own engine request id (the split's
        legs may be in flight on the same engine); the body unread."""
        headers = {"X-Request-Id": call.ctx.request_id + "-hedge"}
        body = decode_body(call.ctx, None)
        return await inst.client.send("POST", call.ctx.path, self.timeout, body, headers)

    def _hedge(self, call: Call, route: Route, inst: Instance) -> Hedge | None:
        """A hedge beside a split's late decode leg on ``inst``: the request colocated
        where a stall would be served (``_rescuer``), with a stall's colocated deadline.
        None at the in-flight bound."""
        guard = self.router.guard
        if not guard.hedge_begin("decode"):
            return None
        assert call.prefill_done is not None
        where = self._rescuer(call, route, inst, call.prefill_instance)
        budget = guard.rescue_budget_s(call.prefill_done - call.start, call.ctx.est_prompt_tokens)
        opening = self.send_hedge(call, where)
        return Hedge(guard, where, "decode", (call.prefill_instance, inst), opening, budget)

    async def _adopt(self, call: Call, hedge: Hedge) -> Opened | None:
        """The hedge's colocated leg serves the request once its first bytes are in (the
        call's split given up, when it had one); None when that leg failed."""
        decision = call.decision
        if await call.watch.race(hedge.wait(), "decode_wait") is None:
            if hedge.rescue:  # the split failed first: its leg was the colocated one, and missed
                self.router.guard.rescue_stalled(hedge.inst, call.ctx.request_id)
            return None
        if not hedge.rescue:  # it beat the split: what the split took so far, for the guard
            now = time.perf_counter()
            done = call.prefill_done
            self.router.decider.observe_late(
                call.ctx.est_prompt_tokens,
                (now if done is None else done) - call.start,
                None if done is None else now - done,
            )
        resp, lease = hedge.adopt("rescue" if hedge.rescue else "colocated")
        call.hold(lease)
        if call.params is not None:
            call.colocate()
        if decision is not None and decision.split:
            call.decide(Decision(False, "hedge"))
        call.decode_instance = hedge.inst
        return Opened(resp, hedge.inst)

    def _rescuer(
        self, call: Call, route: Route, inst: Instance, stalled: Instance | None
    ) -> Instance:
        """Where a split that stalled on decode instance ``inst`` after its prefill leg on
        ``stalled`` is served colocated: ``stalled`` (its cache holds the prompt) with
        ``stalled_on: prefill``, else ``inst``; when ``stalled`` is down, another decode
        before ``inst``."""
        if stalled is None or self.router.guard.config.stalled_on != "prefill":
            return inst
        if stalled.healthy:
            return stalled
        others = [i for i in route.decode_pool if i not in (stalled, inst) and i.healthy]
        return next(self.router.candidates(call.ctx, others, "decode")) if others else inst

    async def open(
        self,
        call: Call,
        route: Route,
        pending: asyncio.Task | None,
        stream: StreamRelay | None,
        first: Instance | None = None,
        rescue_s: float | None = None,
        suspects: tuple[Instance, ...] = (),
    ) -> Opened:
        """The first decode instance to answer 200 (``first``, else the route's decode
        instance, first). ``rescue_s``: the seconds ``first`` has for its first bytes (a
        stalled split's colocated leg). ``suspects``: instances that may be wedged, tried
        after ``first`` only when no other is healthy. Raises ``ProxyError`` (a 4xx passed
        through; 502 when every instance tried failed) or ``ClientGone``."""
        errors: list[str] = []
        guard = self.router.guard
        hedge = call.hedge
        if hedge is not None and hedge.live and call.params is None:
            # colocated now (the hedge beat the prefill leg, the prefill failed, or the split
            # stalled): the hedge's colocated leg serves it, if it answers
            adopted = await self._adopt(call, hedge)
            if adopted is not None:
                return adopted
            if first is hedge.inst:  # its leg there just failed: another instance first
                suspects = (*suspects, first)
                rest = [i for i in route.decode_pool if i not in suspects and i.healthy] or [
                    i for i in route.decode_pool if i is not hedge.inst and i.healthy
                ]
                first = next(self.router.candidates(call.ctx, rest, "decode")) if rest else None
                if first not in suspects:
                    rescue_s = None
        broken = (
            first is None and route.decision.reason == "breaker_open" and guard.wedged(route.decode)
        )
        if broken:  # its breakers are open for its own stalls: it may be wedged itself
            suspects = (route.decode,)
        pool = [i for i in route.decode_pool if i not in suspects and i.healthy]
        if broken and stream is not None and pool:  # (the only decode healthy: waited for)
            rescue_s = self._suspect_budget_s(call)
        candidates = self.router.candidates(
            call.ctx, pool or route.decode_pool, "decode", first or route.decode
        )
        stalled: Instance | None = None  # the prefill instance of a stalled split
        stalled_leg_s = 0.0  # and how long its prefill leg took
        for attempt, inst in enumerate(candidates):
            hedge = call.hedge
            if attempt and hedge is not None and hedge.live:  # the split failed: it serves
                adopted = await self._adopt(call, hedge)
                if adopted is not None:
                    return adopted
            if attempt and call.params is not None and self.protocol.binds_decode:
                call.colocate()
                self.metrics.fallbacks.labels("decode_retry").inc()
            with Lease(inst) as lease:
                if attempt == 0 and pending is not None:
                    opening: Any = pending  # its body was chosen when it was sent
                else:
                    body = self._body(call, inst, call.params, first=attempt == 0)
                # the first attempt of a split: its first token must beat the deadline
                guarded = (
                    attempt == 0
                    and call.params is not None
                    and call.prefill_done is not None
                    and (guard.guards(True, inst) if stream is not None else call.kv_first)
                )
                rescue = attempt == 0 and rescue_s is not None
                if attempt or pending is None:
                    # a guarded leg's first bytes wait for the guard, not for the client
                    sink = (
                        stream.direct_sink()
                        if stream is not None and not (guarded or rescue)
                        else None
                    )
                    opening = self.send_body(call, inst, body, call.ctx.request_id, sink)
                if rescue:
                    assert rescue_s is not None
                    opening = first_bytes(opening, rescue_s)
                elif guarded:
                    assert call.prefill_done is not None
                    guard.probing(call.prefill_instance, inst)
                    left = guard.budget_s(call.ctx.est_prompt_tokens) - (
                        time.perf_counter() - call.prefill_done
                    )
                    opening = first_bytes(opening, left)
                    if stream is not None and self._hedges(call, inst):
                        at = call.start + guard.hedge_s(call.ctx.est_prompt_tokens)
                        opening = race(call, opening, at, partial(self._hedge, call, route, inst))
                try:
                    resp = await call.watch.race(opening, "decode_wait")
                    if isinstance(resp, Hedge):  # its colocated leg answered first
                        adopted = await self._adopt(call, resp)
                        assert adopted is not None
                        return adopted
                    if resp is not None and call.kv_first and resp.status == 200:
                        # the first step's one token is in: the rest comes from D's cache
                        resp = await call.watch.race(self._rest(call, inst, resp), "decode")
                except UpstreamError as exc:
                    self.fleet.upstream_failed(inst, exc)
                    errors.append(f"{inst.label}: {exc.kind}")
                    self._split_failed(call, inst)
                    continue
                except ClientGone:
                    if stream is not None and stream.started:
                        # the stream was under way, from the engine connection's side
                        raise ClientGone("decode_stream") from None
                    raise
                if resp is None and rescue:  # a suspect past its deadline: the next one
                    guard.rescue_stalled(inst, call.ctx.request_id)
                    errors.append(f"{inst.label}: no first token in {rescue_s:.1f} s")
                    continue
                if resp is None:  # a guarded leg past its deadline: closed, and aborted
                    assert call.prefill_done is not None
                    stalled, stalled_leg_s = call.prefill_instance, call.prefill_done - call.start
                    guard.stalled(stalled, inst, call.ctx.request_id)
                    call.split_failed()
                    call.colocate()
                    call.decide(Decision(False, "stall"))
                    break
                if resp.status >= 500:
                    resp.close()
                    errors.append(f"{inst.label}: HTTP {resp.status}")
                    self._split_failed(call, inst)
                    continue
                if resp.status != 200:
                    try:
                        raw = await call.watch.race(resp.read(), "decode")
                    except UpstreamError:
                        raw = b""
                    finally:
                        resp.close()
                    raise passthrough(resp.status, raw)
                if guarded and stream is not None:
                    guard.served(call.prefill_instance, inst)
                    if call.hedge is not None:  # the split answered first: the hedge closed
                        call.hedge.cancel("split")
                call.hold(lease)
                return Opened(resp, inst)
        else:
            hedge = call.hedge
            if hedge is not None and hedge.live:  # the split failed: its hedge may serve
                adopted = await self._adopt(call, hedge)
                if adopted is not None:
                    return adopted
            raise ProxyError(502, "decode failed: " + "; ".join(errors), code="decode_failed")
        # a stall: served colocated now, on the instance the guard's config names first,
        # within a deadline (a stream); both instances of the pair come last after it
        pair = (inst,) if stalled is None else (stalled, inst)
        rescuer = self._rescuer(call, route, inst, stalled)
        rescue_s = (
            guard.rescue_budget_s(stalled_leg_s, call.ctx.est_prompt_tokens)
            if stream is not None and rescuer in pair
            else None
        )
        return await self.open(call, route, None, stream, rescuer, rescue_s, pair)

    def _hedges(self, call: Call, inst: Instance) -> bool:
        """Is this split to ``inst`` hedged when late? A guarded text-mode stream, with the
        guard's ``hedge`` on."""
        return call.ctx.tokens is None and self.router.guard.hedges(call.ctx.stream, inst)

    def _suspect_budget_s(self, call: Call) -> float:
        """Seconds a colocated stream on a decode instance whose breakers are all open has
        for its first token: what the guard gives a prefill leg of its prompt, once the cost
        model measured prefill legs; until then the guard's floor."""
        guard = self.router.guard
        budget = guard.prefill_budget_s(call.ctx.est_prompt_tokens)
        return guard.config.floor_s if budget is None else budget

    def _split_failed(self, call: Call, inst: Instance) -> None:
        """A decode attempt on ``inst`` failed; counted per pair when it was to load a
        prefill's KV."""
        call.split_failed()
        if call.params is not None and call.prefill_instance is not None:
            m = self.metrics
            m.pair(m.split_failures, call.prefill_instance, inst, "decode_error").inc()

    async def _rest(self, call: Call, inst: Instance, probe: UpstreamResponse) -> UpstreamResponse:
        """After a guarded non-streamed split's first step answered 200 on ``inst``: its
        answer read and dropped, the transfer counted, then the client's request sent there
        colocated (the prompt's KV now in ``inst``'s prefix cache); its response, body
        unread. Raises ``UpstreamError``."""
        try:
            await probe.read()
        finally:
            probe.close()
        guard = self.router.guard
        guard.served(call.prefill_instance, inst)
        record_transfer(self.metrics, self.router.decider, call, time.perf_counter())
        call.params = None  # the KV is in: what follows is colocated there
        return await self.send_body(call, inst, decode_body(call.ctx, None), call.ctx.request_id)
