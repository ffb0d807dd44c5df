"""The stall guard's deadlines and per-pair breakers, on their own (the proxy flow tests run
them end to end against fake engines)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from prometheus_client import generate_latest

from tests.unit.proxy.helpers import wait_until
from vllm_pd_ext.proxy.config import DecisionConfig, StallGuardConfig
from vllm_pd_ext.proxy.decision import Decider
from vllm_pd_ext.proxy.metrics import ProxyMetrics
from vllm_pd_ext.proxy.stall_guard import StallGuard
from vllm_pd_ext.util.prom import parse_metrics

P: Any = SimpleNamespace(label="p")  # what the guard reads of an instance: its label
D: Any = SimpleNamespace(label="d")


def _guard(**config) -> tuple[StallGuard, Decider, ProxyMetrics]:
    decider = Decider(DecisionConfig(cost_min_samples=2))
    metrics = ProxyMetrics()
    return StallGuard(StallGuardConfig(**config), decider, metrics), decider, metrics


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
    assert guard.allows(P, D) and _breaker(metrics) == 0
    guard.stalled(P, D, "r3")
    assert not guard.allows(P, D) and _breaker(metrics) == 1
    assert guard.allows(D, P)  # another pair (the other way round) is not affected


def test_after_the_open_time_one_probe_passes_and_its_outcome_decides():
    guard, _, metrics = _guard(breaker_stalls=1, breaker_open_s=0.05, breaker_max_open_s=600)
    guard.stalled(P, D, "r1")
    assert not guard.allows(P, D)
    wait_until(lambda: guard.allows(P, D), timeout=10)  # the probe
    assert not guard.allows(P, D)  # one probe per open time
    guard.stalled(P, D, "probe")  # it stalled: open again, twice as long
    pair = guard._pairs[("p", "d")]
    assert pair.open_s == 0.1 and pair.open_until > time.monotonic() - 0.1
    wait_until(lambda: guard.allows(P, D), timeout=10)
    guard.served(P, D)  # the probe came through: closed
    assert guard.allows(P, D) and guard.allows(P, D) and _breaker(metrics) == 0
    assert not guard.stalls


def test_a_stall_of_a_split_made_before_the_breaker_opened_does_not_extend_it():
    guard, _, _ = _guard(breaker_stalls=1, breaker_open_s=600, breaker_max_open_s=6000)
    guard.stalled(P, D, "r1")  # opens it for 600 s
    until = guard._pairs[("p", "d")].open_until
    guard.stalled(P, D, "r2")  # in flight before it opened: not a probe
    pair = guard._pairs[("p", "d")]
    assert (pair.open_until, pair.open_s) == (until, 600)
