"""The stall guard: a split request is never left waiting on a KV transfer that stalls.

A split pays the KV transfer before its first token. When the transfer stalls (a connector
waiting for blocks whose lease expired, a peer that stopped answering), the decode engine
waits, and the client with it, far longer than a colocated prefill would have taken. So a
guarded decode leg (a split) gets a deadline from the prefill leg's end: ``factor`` times the
typical transfer for its prompt (the recent median, ``Decider.expected_transfer_s``) once
enough splits are measured, and never less than ``floor_s``. If the leg's first body bytes
(its first token) have not arrived by then, and so the client has seen nothing yet, the leg
is closed (the engine aborts the request and frees its blocks) and the request is served
colocated, on the prefill instance that just computed its prompt (``stalled_on``); counted
in ``vllm_pd_fallbacks_total{reason="stall"}`` and logged. That instance may itself have
frozen since its leg, so a stream's colocated leg there has a deadline too: ``factor``
times its prefill leg for this request (it computes no more than that leg did; the
measured leg for its length when shorter), at least ``floor_s``; past it the leg is closed
and the next instance tried (``reason="colocated_stall"``).

A non-streamed answer shows nothing until it is whole, so with ``non_streamed`` on (default) a
non-streamed split's decode leg is sent in two steps: first the one-token leg with the KV
transfer params (its answer is its first token, under the deadline), then the client's request
as it came, colocated on the same instance, whose prefix cache now holds the prompt's loaded
blocks: the answer is the engine's own, at the cost of one more engine step and the prompt's
last partial block.

A guarded leg whose answer ends, or breaks, before any body byte counts as a stall too (the
client has seen nothing yet: served colocated). The deadline counts the decode's own queueing,
so ``floor_s`` is set with room for it; once splits are measured the expected transfer gap
(prefill done -> first token) includes that queueing.

A prefill leg that misses its own deadline (``prefill_budget_s``) is a stall of its pair
too: a prefill instance that keeps stalling trips the breaker just as a stalled transfer does.

The hedge (``hedge``, on by default; ``hedge.py``). A deadline alone makes a stall cost the
deadline plus the colocated answer after it, so a short deadline cuts healthy legs (their work
wasted) and a long one leaves the stall in the tail (here at least ``floor_s``, and a prefill
leg has no deadline until measured). So a guarded split stream that is late gets its colocated
leg started beside it instead of after it: late is ``hedge_factor`` times its typical split
(the measured prefill leg plus transfer gap for its prompt) plus ``hedge_margin_s`` from the
split's start, ``hedge_unmeasured_s`` until measured (about a colocated answer's time), one
clock for both legs. Then the request runs colocated too, once, with its own engine request id
(``-hedge`` appended): on the split's decode instance while the prefill leg is late (it has
computed nothing yet), on the instance a stall is served on (``stalled_on``) while the decode
leg waits for its first token. Whichever leg has its first body bytes first serves the request
and the other is closed (the engine aborts it and frees its blocks); a hedge started beside the
prefill leg races the decode leg too. Only before the client has seen a byte (the guarded legs'
first bytes wait for the guard). The deadlines stay as the hard stop behind it: a split leg
past its deadline is closed and counted as before, and the request takes the hedge's leg if it
answers, else goes on to the stall's colocated leg; the hedge's leg has a stall's colocated
deadline (when it began beside the prefill leg, the prefill leg's deadline, or the prefill
timeout until measured). At most ``hedge_max_in_flight`` hedges run at once (a late split
beyond that waits alone, counted ``bound``), so a loaded fleet does not double its work.
``vllm_pd_hedges_total{leg,outcome}`` counts each by the leg that was late and which leg won
(split, colocated), or rescue (the split leg failed or missed its deadline first, counted as
that, and the hedge's leg served), failed, bound, abandoned (the client left); a colocated win
is also a fallback (``vllm_pd_fallbacks_total{reason="hedge"}``) and a lost race of the pair
(the split was slower than colocated started after it): its breaker opens when more than half
of its last ``2 x breaker_stalls`` splits lost (a pair usually slower than colocated), or when
the split was its probe, not for an occasional loss (a queue, a busy host); what the split took
until then a sample of the typical legs (``Decider.observe_late``: splits that all lose still
measure the pair). A split leg that fails while hedged (``Call.split_failed``) is counted as
that once; the hedge's leg then serves as its rescue. Not hedged: non-streamed
answers (their decode leg is two steps), token mode, and several prompts at once.

A prefill-decode pair that stalls ``breaker_stalls`` times in a row gets no splits for
``breaker_open_s`` (decision reason ``breaker_open``; ``vllm_pd_breaker_open{prefill,decode}``
is 1 meanwhile, and one WARNING line says so). Then one guarded split probes it: a
first token in time closes the breaker, another stall opens it for twice as long, up to
``breaker_max_open_s``. A pair whose breaker a probe closed is remembered for
``breaker_max_open_s``: a stall in that time opens it again at once (not after
``breaker_stalls``) for twice as long as it was last open, so a pair that stalls on and off
is not given a fresh run of stalls each time one probe comes through; a first token in time
after that time forgets it. Each kind of stall line (stall, prefill stall, failed rescue) is
logged at most every ``LOG_EVERY_S`` (the counters count every one).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from vllm_pd_ext.proxy.config import StallGuardConfig
from vllm_pd_ext.proxy.decision import Decider
from vllm_pd_ext.proxy.fleet import Instance
from vllm_pd_ext.proxy.metrics import ProxyMetrics
from vllm_pd_ext.util.throttle import Throttle

logger = logging.getLogger(__name__)

#: Pairs with a stall on record, at most (the oldest forgotten first).
MAX_PAIRS = 4096
#: Seconds between two stall lines in the log.
LOG_EVERY_S = 10.0


@dataclass(slots=True)
class _Pair:
    stalls: int = 0  # in a row
    open_until: float = 0.0  # monotonic; 0: closed
    open_s: float = 0.0  # how long it was last opened for
    probe_at: float = -1e18  # when the last probe was sent (monotonic)
    closed_at: float = -1e18  # when a probe last closed its breaker (monotonic)
    decode_side: bool = False  # a decode leg's stall among those since it last closed
    #: The pair's last hedged-or-guarded splits: True for one its hedge beat (``lost``),
    #: False for one served in time (bounded by ``StallGuard.races``).
    races: deque[bool] = field(default_factory=deque)


class StallGuard:
    """Deadlines for guarded decode legs, and the per-pair breakers. Event loop only."""

    def __init__(
        self,
        config: StallGuardConfig,
        decider: Decider,
        metrics: ProxyMetrics,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.decider = decider
        self.metrics = metrics
        self._clock = clock
        self._pairs: OrderedDict[tuple[str, str], _Pair] = OrderedDict()
        # one per kind of line, so frequent stall lines never hide a rescue that failed
        self._log_prefill = Throttle(LOG_EVERY_S, clock)
        self._log_rescue = Throttle(LOG_EVERY_S, clock)
        self._log_stall = Throttle(LOG_EVERY_S, clock)
        #: Hedged requests whose two legs are both running (``hedge_begin``, ``hedge_end``).
        self.hedging = 0

    @property
    def stalls(self) -> bool:
        """Is any pair's stall on record (else every pair may split)?"""
        return bool(self._pairs)

    def guards(self, stream: bool, decode: Instance) -> bool:
        """Is a split of this kind to ``decode`` guarded? A stream is; a non-streamed answer
        when ``non_streamed`` is on and ``decode`` keeps prompts in its prefix cache (its
        second step is answered from there)."""
        cfg = self.config
        return cfg.enabled and (stream or (cfg.non_streamed and decode.prefix_caching is True))

    def hedges(self, stream: bool, decode: Instance) -> bool:
        """Is a split of this kind to ``decode`` hedged when late? A guarded stream, with
        ``hedge`` on."""
        return self.config.hedge and stream and self.guards(stream, decode)

    def hedge_s(self, prompt_tokens: int) -> float:
        """Seconds from a split's start (its prefill leg sent) after which it is late and
        hedged: ``hedge_factor`` times its typical split (the measured prefill leg and
        transfer gap for a prompt this long) plus ``hedge_margin_s``, at least
        ``hedge_min_s``; ``hedge_unmeasured_s`` until measured."""
        cfg = self.config
        prefill = self.decider.expected_prefill_s(prompt_tokens)
        transfer = self.decider.expected_transfer_s(prompt_tokens)
        if prefill is None or transfer is None:
            return cfg.hedge_unmeasured_s
        return max(cfg.hedge_min_s, cfg.hedge_factor * (prefill + transfer) + cfg.hedge_margin_s)

    def hedge_begin(self, leg: str) -> bool:
        """May a hedge start beside a late ``leg`` (prefill, decode)? Taken when True (give it
        back with ``hedge_end``); False, counted, with ``hedge_max_in_flight`` running."""
        if self.hedging >= self.config.hedge_max_in_flight:
            self.metrics.hedges.labels(leg, "bound").inc()
            return False
        self.hedging += 1
        return True

    def hedge_end(self, leg: str, outcome: str, prefill: Instance | None, decode: Instance) -> None:
        """A hedge begun beside a split's late ``leg`` across this pair is over: ``outcome``
        says which leg answered first (split, colocated), that its leg served after the split
        had failed or missed its deadline (rescue: counted as that), or that it failed or the
        client left. A colocated leg that answered first is a fallback, and a lost race of
        the pair for its breaker (``_lost``)."""
        self.hedging -= 1
        self.metrics.hedges.labels(leg, outcome).inc()
        if outcome != "colocated":
            return
        self.metrics.fallbacks.labels("hedge").inc()
        if prefill is not None:
            self.metrics.pair(self.metrics.split_failures, prefill, decode, "hedge").inc()
            self._lost(prefill, decode, decode_side=leg == "decode")

    def budget_s(self, prompt_tokens: int) -> float:
        """Seconds from the prefill leg's end to the decode leg's first token."""
        cfg = self.config
        expected = self.decider.expected_transfer_s(prompt_tokens)
        if expected is None:
            return cfg.floor_s
        return max(cfg.floor_s, cfg.factor * expected)

    def prefill_budget_s(self, prompt_tokens: int) -> float | None:
        """Seconds the prefill leg may take: ``factor`` times what the cost model measured
        for a prompt this long, at least ``floor_s``; None (no deadline) until measured."""
        cfg = self.config
        expected = self.decider.expected_prefill_s(prompt_tokens)
        if not cfg.enabled or expected is None:
            return None
        return max(cfg.floor_s, cfg.factor * expected)

    def rescue_budget_s(self, prefill_leg_s: float, prompt_tokens: int) -> float:
        """Seconds a stalled split's colocated leg has for its first token, its prefill leg
        having taken ``prefill_leg_s``: ``factor`` times that leg (it computes no more), or
        times the measured leg for a prompt this long when that is shorter (a slow prefill
        leg gives no slow rescue), at least ``floor_s``."""
        cfg = self.config
        expected = self.decider.expected_prefill_s(prompt_tokens)
        leg_s = prefill_leg_s if expected is None else min(prefill_leg_s, expected)
        return max(cfg.floor_s, cfg.factor * leg_s)

    def allows(self, prefill: Instance, decode: Instance, guarded: bool) -> bool:
        """May a request split across this pair now? False while its breaker is open; once
        the open time is over, True for a ``guarded`` one while no probe was sent
        in the last ``breaker_open_s``. Changes nothing (``probing`` records a probe sent)."""
        pair = self._pairs.get((prefill.label, decode.label))
        if pair is None or pair.open_until == 0.0:
            return True
        now = self._clock()
        return (
            guarded and now >= pair.open_until and now >= pair.probe_at + self.config.breaker_open_s
        )

    def probing(self, prefill: Instance | None, decode: Instance) -> None:
        """A split across this pair is under way (a probe, if its breaker is open): marked
        when its prefill leg starts, so the requests routed while it runs do not probe too,
        and again when its guarded decode leg is sent."""
        if prefill is None:
            return
        pair = self._pairs.get((prefill.label, decode.label))
        if pair is None or pair.open_until == 0.0:
            return
        now = self._clock()
        if now >= pair.open_until:  # (a split from before it opened is no probe)
            pair.probe_at = now

    def prefill_stalled(
        self, prefill: Instance, decode: Instance, request_id: str, guarded: bool
    ) -> None:
        """A prefill leg for a split to ``decode`` missed its deadline (it is retried, then
        served colocated); a stall of the pair, for its breaker, when the split was
        ``guarded`` (only a guarded split's first token in time closes a breaker, so only
        guarded splits open one)."""
        self.metrics.fallbacks.labels("prefill_stall").inc()
        self.metrics.pair(self.metrics.split_failures, prefill, decode, "prefill_stall").inc()
        if self._log_prefill.ready():
            logger.warning(
                "request %s: the prefill leg on %s took longer than the stall guard's deadline; "
                'trying elsewhere (vllm_pd_fallbacks_total{reason="prefill_stall"} counts each)',
                request_id,
                prefill.label,
            )
        if guarded:
            self._count_stall(prefill, decode, decode_side=False)

    def rescue_stalled(self, inst: Instance, request_id: str) -> None:
        """A stalled split's colocated leg on ``inst`` missed its deadline too."""
        self.metrics.fallbacks.labels("colocated_stall").inc()
        if self._log_rescue.ready():
            logger.warning(
                "request %s: no first token from %s, serving it colocated after a stall, within "
                "the stall guard's deadline; trying the next instance "
                '(vllm_pd_fallbacks_total{reason="colocated_stall"} counts each)',
                request_id,
                inst.label,
            )

    def stalled(self, prefill: Instance | None, decode: Instance, request_id: str) -> None:
        """A guarded leg missed its deadline on this pair."""
        self.metrics.fallbacks.labels("stall").inc()
        self.metrics.pair(self.metrics.split_failures, prefill, decode, "stall").inc()
        if self._log_stall.ready():
            logger.warning(
                "request %s: no first token from %s within the stall guard's deadline after "
                "the prefill on %s; serving it colocated (vllm_pd_fallbacks_total "
                '{reason="stall"} counts each)',
                request_id,
                decode.label,
                prefill.label if prefill is not None else "?",
            )
        if prefill is not None:
            self._count_stall(prefill, decode, decode_side=True)

    def wedged(self, decode: Instance) -> bool:
        """Is a breaker with ``decode`` open for that decode's own stalls (not only for a
        prefill's)? Then it may be wedged itself."""
        label = decode.label
        return any(
            d == label and pair.open_until != 0.0 and pair.decode_side
            for (_, d), pair in self._pairs.items()
        )

    def _record(self, prefill: Instance, decode: Instance) -> _Pair:
        """This pair's record, made if it has none (the oldest forgotten past ``MAX_PAIRS``)."""
        key = (prefill.label, decode.label)
        pair = self._pairs.get(key)
        if pair is None:
            pair = self._pairs[key] = _Pair(races=deque(maxlen=self.races))
            if len(self._pairs) > MAX_PAIRS:
                (old_p, old_d), _ = self._pairs.popitem(last=False)
                self.metrics.breaker_open.remove(old_p, old_d)
        self._pairs.move_to_end(key)
        return pair

    @property
    def races(self) -> int:
        """How many of a pair's last splits its hedges are weighed over: twice
        ``breaker_stalls``."""
        return 2 * self.config.breaker_stalls

    def _count_stall(self, prefill: Instance, decode: Instance, decode_side: bool) -> None:
        """One more stall in a row on this pair: its breaker opens at ``breaker_stalls``, or
        again (for twice as long) when the stall was a probe's or came soon after a probe
        closed it."""
        pair = self._record(prefill, decode)
        pair.stalls += 1
        pair.decode_side = pair.decode_side or decode_side
        cfg = self.config
        now = self._clock()
        if pair.open_until != 0.0 and now < pair.open_until:
            return  # split before the breaker opened: it stays open as long as it was
        probing = pair.open_until != 0.0
        relapse = now < pair.closed_at + cfg.breaker_max_open_s
        if probing or relapse or pair.stalls >= cfg.breaker_stalls:
            why = f"{pair.stalls} stalls in a row"
            self._open(pair, prefill, decode, now, probing or relapse, why)

    def _lost(self, prefill: Instance, decode: Instance, decode_side: bool) -> None:
        """A split on this pair lost to its hedge (slower than colocated started after it).
        Its breaker opens when the pair's splits lose more often than not (more than half of
        its last ``races``), or for twice as long when the split was its probe: a pair that
        is usually slower than colocated gets no splits, while an occasional loss (a queue,
        a busy host) stops nothing."""
        pair = self._record(prefill, decode)
        pair.races.append(True)
        now = self._clock()
        if pair.open_until != 0.0 and now < pair.open_until:
            return  # split before the breaker opened
        probing = pair.open_until != 0.0
        if probing or 2 * sum(pair.races) > self.races:
            pair.decode_side = pair.decode_side or decode_side
            why = f"{sum(pair.races)} of its last {len(pair.races)} splits slower than colocated"
            self._open(pair, prefill, decode, now, probing, why)

    def _open(
        self, pair: _Pair, prefill: Instance, decode: Instance, now: float, doubled: bool, why: str
    ) -> None:
        """No splits across this pair for ``breaker_open_s``, or twice as long as last time."""
        cfg = self.config
        pair.open_s = (
            min(2 * pair.open_s, cfg.breaker_max_open_s) if doubled else cfg.breaker_open_s
        )
        pair.open_until = now + pair.open_s
        pair.races.clear()
        self.metrics.breaker_open.labels(prefill.label, decode.label).set(1)
        logger.warning(
            "no splits from %s to %s for %.0f s: %s", prefill.label, decode.label, pair.open_s, why
        )

    def served(self, prefill: Instance | None, decode: Instance) -> None:
        """A guarded leg's first token came in time: no stalls in a row now; a breaker
        past its open time closes (remembered for ``breaker_max_open_s``), a record with
        neither is cleared. One that came while the breaker is open (a split sent before it
        opened) changes nothing."""
        if prefill is None:
            return
        key = (prefill.label, decode.label)
        pair = self._pairs.get(key)
        if pair is None:
            return
        pair.races.append(False)
        now = self._clock()
        if pair.open_until != 0.0:
            if now < pair.open_until:
                return
            pair.open_until = 0.0
            pair.closed_at = now
            pair.stalls = 0
            pair.decode_side = False
            self.metrics.breaker_open.remove(prefill.label, decode.label)
            logger.warning("splits from %s to %s again", prefill.label, decode.label)
        elif now < pair.closed_at + self.config.breaker_max_open_s or any(pair.races):
            pair.stalls = 0
        else:
            del self._pairs[key]
