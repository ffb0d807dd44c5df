"""The prefill leg of a split request: the prompt's KV computed on a prefill instance.

Serial protocols (NIXL, MoRI-IO read, pdext read) send the prefill leg alone; its answer's
``kv_transfer_params`` become the decode leg's. Concurrent protocols (Mooncake, MoRI-IO write,
pdext write) send the decode leg first (``send_decode``) with params the protocol builds, then
the prefill leg beside it; the decode leg's pending response goes on to the decode stage.

A failed attempt (unreachable, 5xx, timeout, no ``kv_transfer_params``) is retried on another
prefill instance, up to ``prefill_retries``; then ``LegFailed``. A 4xx is the client's mistake:
``ProxyError``, passed through. A hedged split (``stall_guard.py``) whose colocated leg answers
before its prefill leg raises ``HedgeWon`` (the prefill leg closed).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from vllm_pd_ext.proxy.call import Call
from vllm_pd_ext.proxy.errors import passthrough
from vllm_pd_ext.proxy.fleet import Fleet, Instance, Lease
from vllm_pd_ext.proxy.hedge import Hedge, HedgeWon, race
from vllm_pd_ext.proxy.legs import one_token_body
from vllm_pd_ext.proxy.protocols import MissingCoordinates, PDProtocol
from vllm_pd_ext.proxy.routing import Route, Router
from vllm_pd_ext.proxy.upstream import (
    Timeouts,
    UpstreamError,
    UpstreamResponse,
    discard,
    json_object,
)
from vllm_pd_ext.transfer_params import prefill_cached_tokens

#: Sends the decode leg to an instance with the given params; the opened response.
SendDecode = Callable[[Call, Instance, dict[str, Any]], Awaitable[UpstreamResponse]]
#: Sends a hedge's colocated leg to an instance; the opened response.
SendHedge = Callable[[Call, Instance], Awaitable[UpstreamResponse]]


class LegFailed(Exception):
    """Every instance tried for one leg failed with a server-side error."""


class _AttemptFailed(Exception):
    """One attempt at a leg failed in a way another instance may not."""


@dataclass(slots=True)
class Prefilled:
    """A prefill leg that succeeded."""

    #: The decode leg's ``kv_transfer_params``.
    params: dict[str, Any]
    #: Prompt tokens the prefill instance found in its own prefix cache, when it said.
    cached: int | None
    #: The prefill instance that computed it.
    instance: Instance
    #: Concurrent protocols: the decode leg, already sent to the route's decode instance.
    pending: asyncio.Task | None = None


class PrefillLeg:
    def __init__(
        self,
        protocol: PDProtocol,
        router: Router,
        fleet: Fleet,
        timeout: Timeouts,
        send_decode: SendDecode,
        send_hedge: SendHedge,
        hedge: bool = True,
    ):
        self.protocol = protocol
        self.router = router
        self.fleet = fleet
        self.timeout = timeout
        self.send_decode = send_decode
        self.send_hedge = send_hedge
        #: Are late prefill legs hedged (as the stall guard says)?
        self.hedge = hedge

    async def run(self, call: Call, route: Route) -> Prefilled:
        """Run the leg, retried on other prefill instances. Raises ``LegFailed``,
        ``ClientGone`` (the client left while it ran) or ``ProxyError`` (a 4xx)."""
        if self.protocol.concurrent:
            return await self._concurrent(call, route)
        return await call.watch.race(self._serial(call, route), "prefill")

    async def _serial(self, call: Call, route: Route) -> Prefilled:
        errors: list[str] = []
        for inst in self.router.candidates(call.ctx, route.prefill_pool, "prefill"):
            try:
                plan = self.protocol.plan(call.ctx.request_id, inst.config, route.decode.config)
                answer, usage = await self._once(call, inst, route.decode, plan.prefill_params)
            except (MissingCoordinates, _AttemptFailed) as exc:
                call.split_failed()
                errors.append(str(exc))
                continue
            if answer is None:
                call.split_failed()
                errors.append(f"{inst.label}: no kv_transfer_params (is a KV connector set?)")
                continue
            return Prefilled(answer, cached_tokens(answer, usage), inst)
        raise LegFailed("; ".join(errors) or "no healthy prefill instance")

    async def _concurrent(self, call: Call, route: Route) -> Prefilled:
        """Send the decode leg, then the prefill leg beside it. If the prefill fails, the
        pending decode request is cancelled (the engine frees what it allocated) before the
        next prefill instance is tried."""
        errors: list[str] = []
        for inst in self.router.candidates(call.ctx, route.prefill_pool, "prefill"):
            try:
                plan = self.protocol.plan(call.ctx.request_id, inst.config, route.decode.config)
            except MissingCoordinates as exc:
                errors.append(str(exc))
                continue
            assert plan.decode_params is not None
            pending = asyncio.ensure_future(
                self.send_decode(call, route.decode, plan.decode_params)
            )
            try:
                _, usage = await call.watch.race(
                    self._once(call, inst, route.decode, plan.prefill_params), "prefill"
                )
            except _AttemptFailed as exc:
                call.split_failed()
                await discard(pending)
                errors.append(str(exc))
                continue
            except BaseException:
                await discard(pending)
                raise
            return Prefilled(plan.decode_params, cached_tokens(None, usage), inst, pending)
        raise LegFailed("; ".join(errors) or "no healthy prefill instance")

    async def _once(
        self, call: Call, inst: Instance, decode: Instance, params: dict[str, Any]
    ) -> tuple[dict[str, Any] | None, dict | None]:
        """One attempt on ``inst`` for a split to ``decode``: its answer's
        kv_transfer_params and usage."""
        ctx = call.ctx
        if ctx.tokens is not None:
            call.engines.append(inst)
        guard = self.router.guard
        guarded = guard.guards(ctx.stream, decode)
        if guarded:
            guard.probing(inst, decode)
        budget = guard.prefill_budget_s(ctx.est_prompt_tokens)
        headers = {"X-Request-Id": ctx.request_id}
        trace = call.trace
        span = trace.leg("prefill", inst, headers) if trace is not None else None
        with Lease(inst):
            fetch = asyncio.wait_for(
                inst.client.fetch(
                    "POST", ctx.path, self.timeout, one_token_body(ctx, params), headers
                ),
                budget,
            )
            try:
                if self.hedge and ctx.tokens is None and guard.hedges(ctx.stream, decode):
                    at = call.start + guard.hedge_s(ctx.est_prompt_tokens)
                    got = await race(call, fetch, at, lambda: self._hedge(call, inst, decode))
                    if isinstance(got, Hedge):  # its colocated leg answered first
                        if trace is not None:
                            trace.leg_done(span, error="hedge_won")
                        raise HedgeWon
                    status, raw = got
                else:
                    status, raw = await fetch
            except UpstreamError as exc:
                if trace is not None:
                    trace.leg_done(span, error=exc.kind)
                self.fleet.upstream_failed(inst, exc)
                raise _AttemptFailed(f"{inst.label}: {exc.kind}") from None
            except TimeoutError:  # the stall guard's deadline: the engine aborts it
                if trace is not None:
                    trace.leg_done(span, error="stall_guard_deadline")
                guard.prefill_stalled(inst, decode, ctx.request_id, guarded)
                raise _AttemptFailed(f"{inst.label}: past the stall guard's deadline") from None
        if trace is not None:
            trace.leg_done(span, status)
        if 400 <= status < 500:
            raise passthrough(status, raw)
        if status != 200:
            raise _AttemptFailed(f"{inst.label}: HTTP {status}")
        data = json_object(raw)
        if data is None:
            raise _AttemptFailed(f"{inst.label}: the answer is not a JSON object")
        answer = data.get("kv_transfer_params")
        return (answer if isinstance(answer, dict) else None), data.get("usage")

    def _hedge(self, call: Call, inst: Instance, decode: Instance) -> Hedge | None:
        """A hedge beside a late prefill leg on ``inst``: the request colocated on ``decode``,
        with the prefill leg's deadline for its first token. None at the in-flight bound."""
        guard = self.router.guard
        if not guard.hedge_begin("prefill"):
            return None
        budget = guard.prefill_budget_s(call.ctx.est_prompt_tokens)
        if budget is None:
            budget = self.timeout.total or guard.config.floor_s
        opening = self.send_hedge(call, decode)
        return Hedge(guard, decode, "prefill", (inst, decode), opening, budget)


def cached_tokens(params: dict[str, Any] | None, usage: dict[str, Any] | None) -> int | None:
    """Prompt tokens the prefill instance found in its own prefix cache, when it says."""
    cached = prefill_cached_tokens(params)
    if cached is not None:
        return cached
    details = (usage or {}).get("prompt_tokens_details") or {}
    value = details.get("cached_tokens")
    return value if isinstance(value, int) else None
