"""The stall guard's deadlines and per-pair breakers, on their own (the proxy flow tests run
them end to end against fake engines)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import generate_latest

from vllm_pd_ext.proxy import metrics as metrics_module
from vllm_pd_ext.proxy.config import DecisionConfig, StallGuardConfig
from vllm_pd_ext.proxy.decision import Decider
from vllm_pd_ext.proxy.metrics import ProxyMetrics
from vllm_pd_ext.proxy.stall_guard import StallGuard
from vllm_pd_ext.util.prom import parse_metrics

P: Any = SimpleNamespace(label="p")  # what the guard reads of an instance: its label
D: Any = SimpleNamespace(label="d")


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _guard(clock: Clock | None = None, **config) -> tuple[StallGuard, Decider, ProxyMetrics]:
    decider = Decider(DecisionConfig(cost_min_samples=2))
    metrics = ProxyMetrics()
    guard = StallGuard(StallGuardConfig(**config), decider, metrics, clock or Clock())
    return guard, decider, metrics


def _breaker(metrics: ProxyMetrics) -> float:
    text = generate_latest(metrics.registry).decode()
    return parse_metrics(text).total("vllm_pd_breaker_open", prefill="p", decode="d")


def test_the_deadline_is_the_floor_until_transfers_are_measured_then_a_multiple():
    guard, decider, _ = _guard(floor_s=0.5, factor=4.0)
    assert guard.budget_s(1000) == 0.5
    decider.observe(1000, prefill_s=0.2, transfer_gap_s=0.3)
    assert guard.budget_s(1000) == 0.5  # one sample: not measured enough
    decider.observe(1000, prefill_s=0.2, transfer_gap_s=0.3)
    assert abs(guard.budget_s(1000) - 1.2) < 1e-9  # 4 x 0.3 s
    assert guard.budget_s(10) == 0.5  # the floor still holds for short prompts


def test_stalls_in_a_row_open_the_breaker_one_served_leg_clears_the_record():
    guard, _, metrics = _guard(breaker_stalls=2, breaker_open_s=600)
    guard.stalled(P, D, "r1")
    guard.served(P, D)  # not in a row any more
    guard.stalled(P, D, "r2")
    assert guard.allows(P, D, True) and _breaker(metrics) == 0
    guard.stalled(P, D, "r3")
    assert not guard.allows(P, D, True) and _breaker(metrics) == 1
    assert guard.allows(D, P, True)  # another pair (the other way round) is not affected


def test_after_the_open_time_one_guarded_probe_passes_and_its_outcome_decides():
    clock = Clock()
    guard, _, metrics = _guard(clock, breaker_stalls=1, breaker_open_s=30, breaker_max_open_s=600)
    guard.stalled(P, D, "r1")
    clock.now += 29.9
    assert not guard.allows(P, D, True)
    clock.now += 0.2
    assert guard.allows(P, D, True) and guard.allows(P, D, True)  # asking spends nothing
    assert not guard.allows(P, D, False)  # an unguarded split would probe blind
    guard.probing(P, D)  # the probe is sent
    assert not guard.allows(P, D, True)  # one probe per open time
    guard.stalled(P, D, "probe")  # it stalled: open again, twice as long
    clock.now += 59.9
    assert not guard.allows(P, D, True)
    clock.now += 0.2
    assert guard.allows(P, D, True)
    guard.probing(P, D)
    guard.served(P, D)  # the probe came through: closed, and its series gone
    assert guard.allows(P, D, False)
    assert "vllm_pd_breaker_open{" not in generate_latest(metrics.registry).decode()


def test_a_pair_that_stalls_soon_after_a_probe_closed_its_breaker_is_stopped_at_once():
    """On and off: one stall soon after a probe closed the breaker opens it again (not after
    breaker_stalls), for twice as long as last time; once the pair has served for
    breaker_max_open_s it is forgotten and needs breaker_stalls in a row again."""
    clock = Clock()
    guard, _, metrics = _guard(clock, breaker_stalls=3, breaker_open_s=30, breaker_max_open_s=600)
    for i in range(3):
        guard.stalled(P, D, f"r{i}")
    assert not guard.allows(P, D, True)  # open for 30 s
    clock.now += 31
    guard.probing(P, D)
    guard.served(P, D)  # closed
    assert guard.allows(P, D, False) and _breaker(metrics) == 0
    clock.now += 100
    guard.served(P, D)
    guard.stalled(P, D, "relapse")
    assert not guard.allows(P, D, True) and _breaker(metrics) == 1
    clock.now += 59.9
    assert not guard.allows(P, D, True)  # 60 s: twice as long
    clock.now += 0.2
    guard.probing(P, D)
    guard.served(P, D)  # closed again
    clock.now += 601
    guard.served(P, D)  # served past the memory: forgotten
    assert not guard.stalls
    for i in range(2):
        guard.stalled(P, D, f"late{i}")
    assert guard.allows(P, D, True)  # 2 of 3 in a row: still closed


def test_a_leg_served_while_the_breaker_is_open_does_not_close_it():
    clock = Clock()
    guard, _, metrics = _guard(clock, breaker_stalls=1, breaker_open_s=30)
    guard.stalled(P, D, "r1")
    clock.now += 5
    guard.served(P, D)  # a split sent before the breaker opened, served in time
    assert not guard.allows(P, D, True) and _breaker(metrics) == 1


def test_a_stall_of_a_split_made_before_the_breaker_opened_does_not_extend_it():
    clock = Clock()
    guard, _, _ = _guard(clock, breaker_stalls=1, breaker_open_s=600, breaker_max_open_s=6000)
    guard.stalled(P, D, "r1")  # opens it for 600 s
    clock.now += 10
    guard.stalled(P, D, "r2")  # in flight before it opened: not a probe
    clock.now += 591
    assert guard.allows(P, D, True)  # open 600 s from the first stall, no longer


def test_stall_lines_are_rate_limited_and_every_stall_counted(caplog):
    clock = Clock()
    guard, _, metrics = _guard(clock, breaker_stalls=100)
    with caplog.at_level("WARNING"):
        for i in range(5):
            guard.stalled(P, D, f"r{i}")
        clock.now += 11
        guard.stalled(P, D, "r5")
    lines = [r for r in caplog.records if "stall guard" in r.getMessage()]
    assert len(lines) == 2
    text = generate_latest(metrics.registry).decode()
    assert parse_metrics(text).total("vllm_pd_fallbacks_total", reason="stall") == 6


def test_each_kind_of_stall_line_has_its_own_rate_limit(caplog):
    """Frequent stall lines never hide the first line of a rescue that failed too, or of a
    prefill leg past its deadline."""
    guard, _, _ = _guard(Clock(), breaker_stalls=100)
    with caplog.at_level("WARNING"):
        for i in range(3):
            guard.stalled(P, D, f"r{i}")
            guard.rescue_stalled(P, f"r{i}")
            guard.prefill_stalled(P, D, f"r{i}", guarded=True)
    lines = [r.getMessage() for r in caplog.records]
    assert sum("serving it colocated (" in m for m in lines) == 1
    assert sum("serving it colocated after a stall" in m for m in lines) == 1
    assert sum("the prefill leg on" in m for m in lines) == 1


def test_streams_are_guarded_whole_answers_only_to_decodes_that_cache_prompts():
    """A non-streamed split is guarded through its one-token first step, which pays only
    where the decode instance answers the second step from its prefix cache."""
    instances: list[Any] = [
        SimpleNamespace(label="d", prefix_caching=value) for value in (True, False, None)
    ]
    caching, not_caching, unknown = instances
    guard, _, _ = _guard()
    assert guard.guards(True, not_caching) and guard.guards(True, unknown)
    assert guard.guards(False, caching)
    assert not guard.guards(False, not_caching) and not guard.guards(False, unknown)
    guard, _, _ = _guard(non_streamed=False)
    assert guard.guards(True, caching) and not guard.guards(False, caching)
    guard, _, _ = _guard(enabled=False)
    assert not guard.guards(True, caching) and not guard.guards(False, caching)


def test_pair_labelled_series_are_bounded_later_pairs_count_as_other(monkeypatch):
    """Each prefill -> decode pair has its own series up to MAX_PAIRS pairs a metric; the
    split failures of pairs seen after that are counted under ("other", "other")."""
    monkeypatch.setattr(metrics_module, "MAX_PAIRS", 2)
    guard, _, metrics = _guard(breaker_stalls=100)
    decodes = [SimpleNamespace(label=f"d{i}") for i in range(4)]
    for d in decodes + decodes[:1]:
        guard.stalled(P, d, "req")  # type: ignore[arg-type]
    got = parse_metrics(generate_latest(metrics.registry).decode())
    failures = got.by_label("vllm_pd_split_failures_total", "prefill", "decode", "reason")
    assert failures == {"p/d0/stall": 2.0, "p/d1/stall": 1.0, "other/other/stall": 2.0}


def test_a_rescue_has_the_measured_prefill_legs_deadline_not_a_slow_legs():
    guard, decider, _ = _guard(floor_s=0.5, factor=4.0)
    assert guard.rescue_budget_s(3.0, 1000) == 12.0  # nothing measured: 4 x its own leg
    for _ in range(2):
        decider.observe(1000, prefill_s=0.25, transfer_gap_s=0.1)
    assert guard.rescue_budget_s(3.0, 1000) == 1.0  # 4 x the measured 0.25 s
    assert guard.rescue_budget_s(0.2, 1000) == 0.8  # its own leg, when shorter
    assert guard.rescue_budget_s(0.01, 1000) == 0.5  # the floor


def test_slow_legs_do_not_drag_the_deadlines_up_the_typical_leg_sets_them():
    """A starved prefill engine's slow legs, while fewer than the typical ones, leave the
    deadlines where the typical legs put them: a mean would have let the next slow leg pass."""
    guard, decider, _ = _guard(floor_s=0.1, factor=4.0)
    for _ in range(10):
        decider.observe(1000, prefill_s=0.1, transfer_gap_s=0.05)
    for _ in range(5):
        decider.observe(1000, prefill_s=5.0, transfer_gap_s=3.0)
    assert guard.prefill_budget_s(1000) == pytest.approx(0.4)
    assert guard.budget_s(1000) == pytest.approx(0.2)
    for _ in range(15):  # once slow is what it does, slow is what is expected
        decider.observe(1000, prefill_s=5.0, transfer_gap_s=3.0)
    assert guard.prefill_budget_s(1000) == pytest.approx(20.0)


def test_a_prompt_is_timed_by_prompts_of_about_its_length_once_they_are_measured():
    """Legs have fixed costs besides their per-token ones: once prompts of about a length
    (the same power of two) are measured, their own per-token median times that length;
    until then the median of all lengths does."""
    _, decider, _ = _guard()
    for _ in range(3):  # cost_min_samples is 2
        decider.observe(4000, prefill_s=4.0, transfer_gap_s=0.4)
    assert decider.expected_prefill_s(300) == pytest.approx(0.3)  # from 4000-token prompts
    for _ in range(2):
        decider.observe(300, prefill_s=0.9, transfer_gap_s=0.6)
    assert decider.expected_prefill_s(300) == pytest.approx(0.9)
    assert decider.expected_transfer_s(300) == pytest.approx(0.6)
    assert decider.expected_prefill_s(4000) == pytest.approx(4.0)
    assert decider.expected_prefill_s(5000) == pytest.approx(5.0)  # 4096-8191: all lengths
    decider.observe_late(300, prefill_s=2.0, transfer_gap_s=None)  # a split given up
    decider.observe_late(300, prefill_s=2.0, transfer_gap_s=None)
    assert decider.expected_prefill_s(300) == pytest.approx(2.0)
    assert decider.expected_transfer_s(300) == pytest.approx(0.6)  # its gap was not reached


def test_prefill_stalls_of_unguarded_splits_open_no_breaker():
    """Only a guarded split's first token in time closes a breaker, so an unguarded one's
    prefill stall must not open one (it would never close)."""
    guard, _, metrics = _guard(breaker_stalls=2)
    for i in range(5):
        guard.prefill_stalled(P, D, f"r{i}", guarded=False)
    assert guard.allows(P, D, False) and _breaker(metrics) == 0
    for i in range(2):
        guard.prefill_stalled(P, D, f"g{i}", guarded=True)
    assert not guard.allows(P, D, True) and _breaker(metrics) == 1


def test_a_decode_is_wedged_only_when_its_own_stalls_opened_a_breaker():
    guard, _, _ = _guard(breaker_stalls=1)
    guard.prefill_stalled(P, D, "r1", guarded=True)  # the prefill stalled: D is not suspect
    assert not guard.allows(P, D, True) and not guard.wedged(D)
    guard.stalled(D, P, "r2")  # the pair the other way round: P's decode leg stalled
    assert guard.wedged(P) and not guard.wedged(D)


def test_a_split_from_before_the_breaker_opened_does_not_delay_its_probe():
    clock = Clock()
    guard, _, _ = _guard(clock, breaker_stalls=1, breaker_open_s=30)
    guard.stalled(P, D, "r1")
    clock.now += 25
    guard.probing(P, D)  # a split routed before it opened starts its decode leg
    clock.now += 5.1
    assert guard.allows(P, D, True)  # the probe is due at the end of the open time


def test_a_split_is_late_for_its_hedge_at_a_multiple_of_its_typical_split():
    guard, decider, _ = _guard(
        hedge_factor=1.5, hedge_margin_s=0.05, hedge_unmeasured_s=0.4, hedge_min_s=0.2
    )
    assert guard.hedge_s(1000) == 0.4  # nothing measured: the configured delay
    for _ in range(2):
        decider.observe(1000, prefill_s=0.2, transfer_gap_s=0.1)
    assert guard.hedge_s(1000) == pytest.approx(0.5)  # 1.5 x (0.2 s + 0.1 s) + 0.05 s
    assert guard.hedge_s(100) == 0.2  # 1.5 x 0.03 s + 0.05 s: the least delay


def test_hedges_in_flight_are_bounded_and_a_pair_that_loses_most_races_stops_splitting():
    """A colocated win is a fallback; the pair's breaker opens once more than half of its
    last 2 x breaker_stalls splits lost to their hedge."""
    guard, _, metrics = _guard(hedge_max_in_flight=2, breaker_stalls=2)
    assert guard.hedge_begin("decode") and guard.hedge_begin("prefill")
    assert not guard.hedge_begin("decode")  # the bound: not hedged, counted
    guard.hedge_end("prefill", "split", P, D)
    assert guard.hedge_begin("decode")
    guard.hedge_end("decode", "colocated", P, D)
    guard.hedge_end("decode", "colocated", P, D)  # 2 of 4: not more than half
    assert guard.hedging == 0
    assert guard.allows(P, D, True) and _breaker(metrics) == 0
    guard.hedge_begin("decode")
    guard.hedge_end("decode", "colocated", P, D)  # 3 of 4: the pair's breaker opens
    assert not guard.allows(P, D, True) and _breaker(metrics) == 1
    got = parse_metrics(generate_latest(metrics.registry).decode())
    assert got.by_label("vllm_pd_hedges_total", "leg", "outcome") == {
        "decode/bound": 1.0,
        "prefill/split": 1.0,
        "decode/colocated": 3.0,
    }
    assert got.total("vllm_pd_fallbacks_total", reason="hedge") == 3


def test_a_pair_that_loses_a_race_now_and_then_keeps_splitting_a_probe_that_loses_reopens():
    """Splits served in time between the losses keep the pair splitting (a noisy host, a
    queue); once open, a probe that loses to its hedge opens the breaker again, twice as
    long, as a probe that stalls does."""
    clock = Clock()
    guard, _, metrics = _guard(clock, breaker_stalls=3, breaker_open_s=30, breaker_max_open_s=600)
    for _ in range(3):  # three lost in a row, three served: never more than half of six
        for _ in range(3):
            guard.hedge_end("decode", "colocated", P, D)
        assert guard.allows(P, D, True)
        for _ in range(3):
            guard.served(P, D)
    assert guard.allows(P, D, True) and _breaker(metrics) == 0
    for _ in range(4):
        guard.hedge_end("prefill", "colocated", P, D)
    assert not guard.allows(P, D, True) and _breaker(metrics) == 1
    assert not guard.wedged(D)  # its prefill legs lost: the decode is not suspect
    clock.now += 30.1
    assert guard.allows(P, D, True)
    guard.probing(P, D)
    guard.hedge_end("decode", "colocated", P, D)  # the probe lost: 60 s now
    clock.now += 59.9
    assert not guard.allows(P, D, True)
    clock.now += 0.2
    assert guard.allows(P, D, True)
