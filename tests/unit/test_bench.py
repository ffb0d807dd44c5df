"""The goodput benchmark's arithmetic, workload and outputs, without engines."""

from __future__ import annotations

import pytest

from vllm_pd_ext.tools.bench import (
    RateResult,
    Sample,
    Workload,
    build_requests,
    format_table,
    percentiles,
    slo_attained,
    stalls,
)
from vllm_pd_ext.tools.bench import plot as plot_results


def test_percentiles_pick_ranked_values():
    p = percentiles([0.004, 0.001, 0.002, 0.003, 0.100])
    assert p == pytest.approx({"p50": 3.0, "p90": 100.0, "p99": 100.0, "mean": 22.0})
    assert percentiles([]) == {"p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0}


def test_workload_is_seeded_poisson_with_a_long_short_mix():
    w = Workload(requests_per_rate=400, long_fraction=0.25, long_tokens=50, short_tokens=5)
    a, b = build_requests(w, 4.0), build_requests(w, 4.0)
    assert a == b  # reproducible
    arrivals = [t for t, _ in a]
    assert arrivals == sorted(arrivals)
    mean_gap = arrivals[-1] / len(arrivals)
    assert 0.2 < mean_gap < 0.3  # ~1/rate
    longs = sum(len(p) == 50 for _, p in a)
    assert 70 < longs < 130  # ~25% of 400
    assert build_requests(w, 8.0) != a


def test_table_and_plot(tmp_path):
    rows = [
        RateResult(
            d,
            r,
            10.0,
            9,
            1,
            {"p50": 10, "p90": 20, "p99": 30, "mean": 12},
            {"p50": 1, "p90": 2, "p99": 3, "mean": 1.5},
            7,
            0.7,
        )
        for d in ("colocated", "P/D")
        for r in (1.0, 2.0)
    ]
    table = format_table(rows, 500, 50)
    assert "TTFT <= 500 ms" in table and table.count("P/D") == 2 and "7/10" in table
    png = tmp_path / "out.png"
    plot_results(rows, png, "t")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_slo_attained_counts_answered_requests_within_both_limits():
    samples = [
        Sample(ok=True, ttft_s=0.100, itls_s=[0.010, 0.030]),  # at both limits: counted
        Sample(ok=True, ttft_s=0.1001, itls_s=[0.010]),  # TTFT just over
        Sample(ok=True, ttft_s=0.050, itls_s=[0.010, 0.031]),  # mean ITL 20.5 ms: over
        Sample(ok=False, ttft_s=0.010, itls_s=[0.001]),  # failed: never counted
        Sample(ok=True, ttft_s=0.050),  # one token: no ITL
    ]
    assert slo_attained(samples, slo_ttft_ms=100, slo_itl_ms=20) == 2
    assert slo_attained(samples, slo_ttft_ms=1e9, slo_itl_ms=1e9) == 4
    assert slo_attained(samples, slo_ttft_ms=0, slo_itl_ms=1e9) == 0


def test_stalls_are_answered_requests_over_ten_times_the_median_ttft():
    fast = [Sample(ok=True, ttft_s=0.1) for _ in range(9)]
    slow = Sample(ok=True, ttft_s=1.01)  # just over 10 x 0.1 s
    edge = Sample(ok=True, ttft_s=1.0)  # at 10 x: not a stall
    failed = Sample(ok=False, ttft_s=100.0)  # failed requests are not stalls
    assert stalls([*fast, slow, edge, failed]) == 1
    assert stalls([]) == stalls([failed]) == 0


def test_the_table_shows_stalls_and_fallbacks():
    row = RateResult(
        "P/D", 1.0, 10.0, 10, 0, {"p50": 1, "p90": 2, "p99": 3, "mean": 1},
        {"p50": 1, "p90": 2, "p99": 3, "mean": 1}, 10, 1.0, stalls=2,
        fallbacks={"stall": 3.0, "prefill_failed": 1.0},
    )  # fmt: skip
    line = format_table([row], 500, 50).splitlines()[-1]
    assert line.split()[-5:] == ["2", "prefill_failed", "1,", "stall", "3"]


def test_the_table_says_when_fallbacks_are_unknown():
    row = RateResult(
        "P/D", 1.0, 10.0, 10, 0, {"p50": 1, "p90": 2, "p99": 3, "mean": 1},
        {"p50": 1, "p90": 2, "p99": 3, "mean": 1}, 10, 1.0, fallbacks=None,
    )  # fmt: skip
    assert format_table([row], 500, 50).splitlines()[-1].endswith("n/a (metrics unreadable)")
