"""Where a request goes: its decode instance, whether it is split (``decision.py``, over the
prefill instances the stall guard lets it split with), and which instances a leg tries, in
order, when one fails."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

from vllm_pd_ext.proxy.config import ProxyConfig
from vllm_pd_ext.proxy.decision import Decider, Decision
from vllm_pd_ext.proxy.errors import ProxyError
from vllm_pd_ext.proxy.fleet import Fleet, Instance
from vllm_pd_ext.proxy.kv_events import Lookup
from vllm_pd_ext.proxy.metrics import ProxyMetrics
from vllm_pd_ext.proxy.policies import make_policy
from vllm_pd_ext.proxy.prompt_ids import PromptTokenizer
from vllm_pd_ext.proxy.request import NOT_LOOKED_UP, RequestContext
from vllm_pd_ext.proxy.stall_guard import StallGuard
from vllm_pd_ext.util.throttle import Throttle

logger = logging.getLogger(__name__)


def lookup_of(ctx: RequestContext) -> Lookup | None:
    """The prompt as the engines' prefix indexes look it up, when its token ids are known:
    token mode's (from the render tier), a text-mode completion whose prompt is token ids, or
    a text completion's prompt the proxy's tokenizer made ids of (``Router.tokenize``). None
    for a chat in text mode (its template is the engine's) or a text prompt without a
    tokenizer: those requests are routed on the estimate. Computed once per request."""
    if ctx.lookup is NOT_LOOKED_UP:
        ctx.lookup = _lookup(ctx)
    return ctx.lookup


def _lookup(ctx: RequestContext) -> Lookup | None:
    tokens = ctx.tokens
    if tokens is not None:
        if tokens.more:  # several prompts: served together where the first goes
            return None
        return _with_salt(tokens.prompt_ids, tokens.generate)
    if ctx.route != "completions":
        return None
    prompt = ctx.body.get("prompt")
    if not (isinstance(prompt, list) and prompt and type(prompt[0]) is int):
        return None  # parse_request checked a list's items: all ints, or a batch of prompts
    return _with_salt(prompt, ctx.body)


def _with_salt(ids: list[int], body: dict) -> Lookup:
    salt = body.get("cache_salt")
    return Lookup(ids, salt if isinstance(salt, str) else None)


@dataclass(slots=True)
class Route:
    """One request's way through the fleet, as first chosen."""

    decode: Instance
    decode_pool: list[Instance]
    prefill_pool: list[Instance]
    decision: Decision
    #: The split does not fit its decode instance yet and waits for room (``Router.room``).
    waits: bool = False


class Router:
    """The routing policies (prefill and decode) and the split decision."""

    def __init__(self, config: ProxyConfig, fleet: Fleet, metrics: ProxyMetrics):
        self.config = config
        self.fleet = fleet
        self.metrics = metrics
        self.decider = Decider(config.decision)
        self.guard = StallGuard(config.stall_guard, self.decider, metrics)
        self._no_decode_log = Throttle(10.0)
        self.prefill_policy = make_policy(config.prefill_policy, config.scoring)
        self.decode_policy = make_policy(config.decode_policy, config.scoring)
        self._cache_aware = config.decode_policy == "cache-aware"
        self.tokenizer = PromptTokenizer(config.tokenizer) if config.tokenizer else None

    async def tokenize(self, ctx: RequestContext) -> None:
        """A text completion's prompt made ids by the proxy's ``tokenizer``, off the event
        loop, for ``lookup_of``; nothing for any other request, or without a tokenizer."""
        prompt, tokenizer = ctx.body.get("prompt"), self.tokenizer
        if tokenizer is None or ctx.tokens is not None or not isinstance(prompt, str):
            return
        if ctx.route == "completions":
            ids = await tokenizer.encode(prompt)
            ctx.lookup = _with_salt(ids, ctx.body) if ids else None

    def decode_pool(self) -> list[Instance]:
        """The healthy decode instances; with none, the healthy prefill instances
        (``no_decode_fallback``), which then serve requests whole; 503 when there is none."""
        pool = self.fleet.healthy("decode")
        if not pool and self.config.no_decode_fallback:
            pool = self.fleet.healthy("prefill")
        if not pool:
            raise ProxyError(
                503,
                "no healthy decode instance",
                code="no_upstream",
                retry_after=self.config.health_interval_s,
            )
        return pool

    def route(self, ctx: RequestContext, decode_pool: list[Instance]) -> Route:
        """Pick the decode instance, then decide split or colocated (counted by reason) on
        the prompt's tokens that instance's prefix cache does not hold, when known, and on
        its KV room. A split that does not fit there, with ``decode_room`` ``wait``, is not
        counted yet: ``Route.waits`` says the caller waits for room (``room()``)."""
        route = self._route(ctx, decode_pool)
        if route.waits:
            return route
        self._count(ctx, route)
        return route

    async def room(self, ctx: RequestContext, route: Route) -> Route:
        """``route`` (``waits``) again after each health round that may have freed KV room,
        for up to ``decode_room_wait_s``; then served as routed last (colocated when there
        is still no room). Counted once, with its wait's outcome."""
        deadline = time.monotonic() + self.config.decision.decode_room_wait_s
        self.metrics.room_waiting.inc()
        try:
            while route.waits:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.fleet.next_round(), left)
                route = self._route(ctx, self.decode_pool())
        finally:
            self.metrics.room_waiting.dec()
        outcome = "timeout" if route.waits else "room"
        self.metrics.room_waits.labels(outcome).inc()
        route.waits = False
        self._count(ctx, route)
        return route

    def _count(self, ctx: RequestContext, route: Route) -> None:
        """Count a request's routing once, however often it was routed while it waited: its
        decision, what the cache-aware choice scored on, a fallback for want of a decode."""
        metrics, decision = self.metrics, route.decision
        metrics.child(metrics.decisions, decision.label, decision.reason).inc()
        if self._cache_aware:
            self._count_lookup(lookup_of(ctx), route.decode_pool)
        if decision.reason == "no_decode":
            metrics.fallbacks.labels("no_decode").inc()

    def _route(self, ctx: RequestContext, decode_pool: list[Instance]) -> Route:
        lookup = lookup_of(ctx)
        decode = self.decode_policy.select(ctx.affinity_key, decode_pool, lookup)
        if not decode.serves("decode"):  # no decode instance is healthy: served whole here
            return self._no_decode(ctx, decode, decode_pool)
        cached = decode.cached_tokens(lookup) if lookup is not None else None
        healthy = [p for p in self.fleet.healthy("prefill") if p is not decode]
        guard = self.guard
        prefill_pool = healthy
        if guard.stalls:
            guarded = guard.guards(ctx.stream, decode)
            prefill_pool = [p for p in healthy if guard.allows(p, decode, guarded)]
        free = decode.free_blocks()
        room = (free, decode.block_size) if free is not None else None
        decision = self.decider.decide(ctx, prefill_pool, decode, cached, room)
        if decision.reason == "no_prefill" and healthy:  # there are some: the guard stopped them
            decision = Decision(False, "breaker_open", decision.inputs)
        waits = decision.reason == "decode_full" and self.config.decision.decode_room == "wait"
        return Route(decode, decode_pool, prefill_pool, decision, waits)

    def _count_lookup(self, lookup: Lookup | None, pool: list[Instance]) -> None:
        if not any(i.cache_view == "events" for i in pool):
            basis = "no_events"
        else:
            basis = "events" if lookup is not None else "no_token_ids"
        self.metrics.child(self.metrics.lookups, basis).inc()

    def _no_decode(self, ctx: RequestContext, inst: Instance, pool: list[Instance]) -> Route:
        decision = Decision(False, "no_decode")
        if self._no_decode_log.ready():
            logger.warning(
                "no healthy decode instance: serving requests whole on prefill instances "
                "(request %s on %s)",
                ctx.request_id,
                inst.label,
            )
        return Route(inst, pool, [], decision)

    def candidates(
        self,
        ctx: RequestContext,
        pool: list[Instance],
        leg: str,
        first: Instance | None = None,
    ) -> Iterator[Instance]:
        """Up to 1 + the leg's retries distinct healthy instances of ``pool``, ``first``
        first; every instance after the first counts as a retry."""
        if leg == "prefill":
            policy, retries = self.prefill_policy, self.config.prefill_retries
        else:
            policy, retries = self.decode_policy, self.config.decode_retries
        tried: list[Instance] = []
        lookup = lookup_of(ctx)  # made once; only cache-aware hashes its blocks
        for attempt in range(1 + retries):
            if attempt == 0 and first is not None:
                inst = first
            else:
                left = [p for p in pool if p not in tried and p.healthy]
                if not left:
                    return
                inst = policy.select(ctx.affinity_key, left, lookup)
                if attempt:
                    self.metrics.retries.labels(leg).inc()
            tried.append(inst)
            yield inst
