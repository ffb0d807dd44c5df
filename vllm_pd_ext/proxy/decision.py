"""Per request: split across prefill and decode, or serve colocated on the decode instance.

Rules, in order (the first that applies wins):

1. ``not_splittable``: ``n > 1``, ``best_of`` or a batch of prompts.
2. ``no_prefill``: no healthy prefill instance (``breaker_open``, decided by the router: there
   are some, but the stall guard stopped splits between each of them and the decode instance).
3. ``short_prompt``: estimated prompt tokens below ``min_split_prompt_tokens`` (default 256):
   the transfer and the extra hop cost more than a short prefill stalls anyone.
4. ``cached_on_decode``: the chosen decode instance's prefix cache (from its KV events, when
   the prompt's token ids are known) holds so much of the prompt that the tokens left to
   compute are below ``min_split_prompt_tokens``: it computes them itself, as it would a short
   prompt, and nothing is transferred (a split would move the whole prompt's KV for them).
5. ``decode_full``: the prompt's KV (the blocks its decode instance does not cache, one more
   for the first token) does not fit in the decode instance's free KV blocks, by its
   ``/metrics`` (``num_gpu_blocks``, usage) less the splits routed there since
   (``decode_room``: ``colocated``, the default; with ``wait``, the request waits for room
   first, see ``routing.py``; ``off`` skips this rule). A split's prefill KV would be held
   for a decode that cannot take it yet.
6. ``prefill_overloaded``: every healthy prefill instance has ``max_prefill_waiting`` (default
   8) or more requests queued: a colocated prefill starts sooner.
7. ``transfer_cost`` (with ``cost_model``, after ``cost_min_samples`` measured splits): the
   measured transfer gap for this prompt length exceeds the predicted stall, i.e. the measured
   prefill time for this length times the requests running on the chosen decode instance. At
   light load (nothing running on the decode side) this chooses colocated, as the
   disaggregation guide advises.

Otherwise ``split``.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from vllm_pd_ext.proxy.config import DecisionConfig
from vllm_pd_ext.proxy.request import RequestContext

logger = logging.getLogger(__name__)


class Loaded(Protocol):
    """What a decision reads of an instance (``fleet.Instance`` has it)."""

    running: float
    waiting: float
    in_flight: int


@dataclass(slots=True)
class Decision:
    split: bool
    reason: str
    inputs: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return "split" if self.split else "colocated"


def blocks_needed(prompt_tokens: int, cached_tokens: int, block_size: int) -> int:
    """KV blocks a split's decode instance takes for its prompt: the blocks its prefix cache
    does not hold, and one for the first generated tokens."""
    return math.ceil(prompt_tokens / block_size) - cached_tokens // block_size + 1


class Ewma:
    def __init__(self, alpha: float = 0.2):
        self.alpha = alpha
        self.value: float | None = None
        self.samples = 0

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.alpha * x + (1 - self.alpha) * self.value
        self.samples += 1


class RecentMedian:
    """The median of the last ``window`` samples: the typical one, which a run of slow
    outliers (a starved engine's legs) does not drag up as it drags a mean."""

    def __init__(self, window: int = 64):
        self._recent: deque[float] = deque(maxlen=window)
        self._median: float | None = None  # cached until the next sample
        self.samples = 0

    def add(self, x: float) -> None:
        self._recent.append(x)
        self._median = None
        self.samples += 1

    @property
    def value(self) -> float | None:
        if self._median is None and self._recent:
            ordered = sorted(self._recent)
            self._median = ordered[len(ordered) // 2]
        return self._median


class TypicalByLength:
    """The typical seconds per prompt token of a leg, per prompt length: the recent median of
    prompts of about this length (the same power of two) once it has ``min_samples``, else
    of all lengths. A leg has fixed costs besides its per-token ones, so a per-token figure
    learnt on long prompts alone would give a short one too little time, and the reverse."""

    def __init__(self, min_samples: int):
        self.min_samples = min_samples
        self._all = RecentMedian()
        #: One median per ``int.bit_length`` of the prompt's tokens: at most 64.
        self._by_length: dict[int, RecentMedian] = {}

    def add(self, prompt_tokens: int, seconds: float) -> None:
        per_token = seconds / prompt_tokens
        self._all.add(per_token)
        bucket = self._by_length.get(prompt_tokens.bit_length())
        if bucket is None:
            bucket = self._by_length[prompt_tokens.bit_length()] = RecentMedian()
        bucket.add(per_token)

    def expected(self, prompt_tokens: int) -> float | None:
        """Seconds for a prompt this long (None: fewer than ``min_samples`` measured)."""
        bucket = self._by_length.get(prompt_tokens.bit_length())
        median = bucket if bucket is not None and bucket.samples >= self.min_samples else self._all
        value = median.value
        if value is None or median.samples < self.min_samples:
            return None
        return value * prompt_tokens


class Decider:
    """Makes decisions and learns per-token prefill and transfer costs from measured splits:
    a moving mean for the cost model, the recent median for the stall guard's deadlines (a
    deadline set from a mean that slow legs pulled up would let the next slow legs pass)."""

    def __init__(self, config: DecisionConfig):
        self.config = config
        self.prefill_s_per_token = Ewma()
        self.transfer_s_per_token = Ewma()
        self._typical_prefill = TypicalByLength(config.cost_min_samples)
        self._typical_transfer = TypicalByLength(config.cost_min_samples)

    def observe(self, prompt_tokens: int, prefill_s: float, transfer_gap_s: float) -> None:
        """Record one completed split (called after the first decode token arrives)."""
        if prompt_tokens > 0:
            self.prefill_s_per_token.add(prefill_s / prompt_tokens)
            self.transfer_s_per_token.add(transfer_gap_s / prompt_tokens)
            self._typical_prefill.add(prompt_tokens, prefill_s)
            self._typical_transfer.add(prompt_tokens, transfer_gap_s)

    def observe_late(
        self, prompt_tokens: int, prefill_s: float, transfer_gap_s: float | None
    ) -> None:
        """Record a split given up while under way (its hedge answered first): it took at
        least ``prefill_s`` in its prefill leg and, once that ended, ``transfer_gap_s``
        waiting for its first token (None: the prefill leg had not ended). Only the typical
        legs the stall guard times against learn it, as a sample of what it took so far: so
        they follow a lasting slow-down instead of hedging every split at the old times."""
        if prompt_tokens > 0:
            self._typical_prefill.add(prompt_tokens, prefill_s)
            if transfer_gap_s is not None:
                self._typical_transfer.add(prompt_tokens, transfer_gap_s)

    def expected_prefill_s(self, prompt_tokens: int) -> float | None:
        """The typical measured prefill leg for a prompt this long (None: not measured
        enough)."""
        return self._typical_prefill.expected(prompt_tokens)

    def expected_transfer_s(self, prompt_tokens: int) -> float | None:
        """The typical measured transfer gap for a prompt this long (None: not measured
        enough)."""
        return self._typical_transfer.expected(prompt_tokens)

    def decide(
        self,
        ctx: RequestContext,
        prefill_pool: Sequence[Loaded],
        decode: Loaded,
        cached_tokens: int | None = None,
        room: tuple[int, int] | None = None,
    ) -> Decision:
        """Split or colocated for ``ctx`` on ``decode``, whose prefix cache holds the first
        ``cached_tokens`` of its prompt (None: not known) and which has ``room`` for (free
        KV blocks, tokens per block; None: not known)."""
        cfg = self.config
        tokens = ctx.est_prompt_tokens
        inputs: dict = {
            "est_prompt_tokens": tokens,
            "healthy_prefill": len(prefill_pool),
            "decode_running": decode.running,
        }
        if not ctx.splittable:
            return self._log(ctx, Decision(False, "not_splittable", inputs))
        if not prefill_pool:
            return self._log(ctx, Decision(False, "no_prefill", inputs))
        if tokens < cfg.min_split_prompt_tokens:
            return self._log(ctx, Decision(False, "short_prompt", inputs))
        if cached_tokens is not None:
            inputs["decode_cached_tokens"] = cached_tokens
            if tokens - cached_tokens < cfg.min_split_prompt_tokens:
                return self._log(ctx, Decision(False, "cached_on_decode", inputs))
        if room is not None and cfg.decode_room != "off":
            free, block_size = room
            need = blocks_needed(tokens, cached_tokens or 0, block_size)
            inputs.update(decode_free_blocks=free, kv_blocks_needed=need)
            if need > free:
                return self._log(ctx, Decision(False, "decode_full", inputs))
        min_waiting = min(p.waiting for p in prefill_pool)
        inputs["min_prefill_waiting"] = min_waiting
        if min_waiting >= cfg.max_prefill_waiting:
            return self._log(ctx, Decision(False, "prefill_overloaded", inputs))
        transfer, prefill = self.transfer_s_per_token, self.prefill_s_per_token
        if (
            cfg.cost_model
            and transfer.value is not None
            and prefill.value is not None
            and min(transfer.samples, prefill.samples) >= cfg.cost_min_samples
        ):
            transfer_cost = transfer.value * tokens
            stall_cost = prefill.value * tokens * max(decode.running, decode.in_flight)
            inputs.update(transfer_cost_s=transfer_cost, stall_cost_s=stall_cost)
            if transfer_cost > stall_cost:
                return self._log(ctx, Decision(False, "transfer_cost", inputs))
        return self._log(ctx, Decision(True, "split", inputs))

    @staticmethod
    def _log(ctx: RequestContext, decision: Decision) -> Decision:
        if logger.isEnabledFor(logging.DEBUG):  # (its arguments cost a call of their own)
            logger.debug(
                "request %s: %s (%s) inputs=%s",
                ctx.request_id,
                decision.label,
                decision.reason,
                decision.inputs,
            )
        return decision
