"""Cache-aware scoring: the instance whose prefix cache holds most of the prompt, weighed
against its load, its KV cache usage and its health.

Each candidate gets a score, the highest wins (ties rotate, so equal instances share work)::

    cache_weight     x  the fraction of the prompt's tokens its prefix cache holds
  - load_weight      x  load / (load + load_half)     (load: in flight through this proxy
                                                       + running + 2 x waiting on the engine)
  - kv_usage_weight  x  its KV cache usage (0-1, from the engine's /metrics)
  - health_weight       when its last health check failed (it is not yet ejected)

The cached fraction comes from the instance's prefix index (``kv_events.py``), looked up by the
prompt's token ids. An instance without an index (its engine publishes no KV events to us, or
the subscription failed) is credited the prefix-affinity estimate instead: the rendezvous
owner of the request's affinity key among such instances is credited ``estimate_credit`` of
the prompt, the others nothing. When the prompt's token ids are unknown (a text prompt in text
mode) or no candidate has an index, the choice is ``PrefixAffinity``'s, as before.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from vllm_pd_ext.proxy.policies.base import C
from vllm_pd_ext.proxy.policies.prefix_affinity import PrefixAffinity, weight

if TYPE_CHECKING:
    from vllm_pd_ext.proxy.kv_events import Lookup


class ScoringConfig(BaseModel):
    """The weights of the ``cache-aware`` policy (``policies/cache_aware.py``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cache_weight: float = Field(
        1.0, ge=0, description="score per fraction of the prompt an instance's cache holds"
    )
    load_weight: float = Field(
        1.0, ge=0, description="cost of load, as load / (load + load_half) times this"
    )
    load_half: float = Field(
        4.0, gt=0, description="the load (in flight + running + 2 x waiting) costing half"
    )
    kv_usage_weight: float = Field(
        0.5, ge=0, description="cost per fraction of the engine's KV cache in use"
    )
    health_weight: float = Field(
        1.0, ge=0, description="cost of an instance whose last health check failed"
    )
    estimate_credit: float = Field(
        0.5,
        ge=0,
        le=1,
        description="instances without KV events: the fraction of the prompt credited to "
        "the prefix-affinity owner of its key among them",
    )


class CacheAware:
    def __init__(self, config: ScoringConfig | None = None) -> None:
        self.config = config or ScoringConfig()
        self._counter = itertools.count()
        self._estimate = PrefixAffinity()

    def scores(
        self, key: str, candidates: Sequence[C], cached: Sequence[int | None], tokens: int
    ) -> list[float]:
        """Each candidate's score for a prompt of ``tokens`` tokens of which each holds
        ``cached`` (None: it has no index)."""
        cfg = self.config
        total = max(1, tokens)
        blind = [c for c, n in zip(candidates, cached, strict=True) if n is None]
        owner = max(blind, key=lambda c: weight(key, c.url)) if blind else None
        out = []
        for c, n in zip(candidates, cached, strict=True):
            if n is None:
                fraction = cfg.estimate_credit if c is owner else 0.0
            else:
                fraction = min(n, total) / total
            load = c.load()
            out.append(
                cfg.cache_weight * fraction
                - cfg.load_weight * load / (load + cfg.load_half)
                - cfg.kv_usage_weight * c.kv_usage
                - (cfg.health_weight if c.failures else 0.0)
            )
        return out

    def select(self, key: str, candidates: Sequence[C], prompt: Lookup | None = None) -> C:
        if prompt is None or len(candidates) == 1:
            return self._estimate.select(key, candidates)
        cached = [c.cached_tokens(prompt) for c in candidates]
        if all(n is None for n in cached):  # nobody publishes events to us
            return self._estimate.select(key, candidates)
        scores = self.scores(key, candidates, cached, len(prompt.token_ids))
        start = next(self._counter) % len(candidates)
        order = [*range(start, len(candidates)), *range(start)]
        return candidates[max(order, key=lambda i: scores[i])]
