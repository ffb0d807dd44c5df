"""``vllm-pd bench`` against the real proxy over fake engines: what it reports of stalls and
of the proxy's fallbacks."""

from __future__ import annotations

import asyncio

from tests.unit.proxy.helpers import fleet, proxy
from vllm_pd_ext.tools.bench import Workload, run_rate


def test_bench_reports_the_proxys_stall_fallbacks_by_reason(engines):
    """Every long prompt splits and its decode leg stalls: the stall guard serves each one
    colocated, and the bench run counts those fallbacks (and only those of its own run)."""
    engines["d1"].behavior.kv_stall_s = 600.0
    one_pair = fleet(engines, prefill=("p1",), decode=("d1",))
    workload = Workload(
        rates=(20.0,), requests_per_rate=4, long_fraction=1.0, long_tokens=300, output_tokens=4
    )
    guard = {"floor_s": 0.3, "breaker_stalls": 100}
    with proxy(engines, instances=one_pair, stall_guard=guard) as (base, _):
        for _ in range(2):
            result = asyncio.run(run_rate(base, "m", "P/D", 20.0, workload, 1e6, 1e6))
            assert (result.completed, result.failed) == (4, 0)
            assert result.fallbacks == {"stall": 4.0}
    colocated = asyncio.run(run_rate(engines["d2"].url, "m", "colocated", 20.0, workload, 1, 1))
    assert colocated.fallbacks == {}  # an engine, not our proxy: nothing to read


def test_bench_says_when_the_proxys_metrics_cannot_be_read(engines):
    """With a metrics token set, /metrics answers 401 to the bench: its fallbacks are
    unknown, not none."""
    workload = Workload(rates=(20.0,), requests_per_rate=2, long_fraction=0.0, output_tokens=2)
    with proxy(engines, metrics_token="scrape") as (base, _):
        result = asyncio.run(run_rate(base, "m", "P/D", 20.0, workload, 1e6, 1e6))
    assert result.completed == 2 and result.fallbacks is None
