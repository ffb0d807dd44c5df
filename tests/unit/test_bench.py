"""The goodput benchmark's arithmetic, workload and outputs, without engines."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_pd_ext.cli import build_parser, main
from vllm_pd_ext.tools.bench import (
    Prompts,
    RateResult,
    Sample,
    Workload,
    build_requests,
    format_table,
    percentiles,
    slo_attained,
    stack_configs,
    stalls,
)
from vllm_pd_ext.tools.bench import plot as plot_results

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
ENDPOINTS = ("--colocated", "http://127.0.0.1:1", "--pd", "http://127.0.0.1:2")


def test_percentiles_pick_ranked_values():
    p = percentiles([0.004, 0.001, 0.002, 0.003, 0.100])
    assert p == pytest.approx({"p50": 3.0, "p90": 100.0, "p99": 100.0, "mean": 22.0})
    assert percentiles([]) == {"p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0}


def test_workload_is_seeded_poisson_with_a_long_short_mix():
    w = Workload(requests_per_rate=400, long_fraction=0.25, long_tokens=50, short_tokens=5)
    a, b = build_requests(w, 4.0), build_requests(w, 4.0)
    assert a == b  # reproducible: arrivals and prompt lengths
    arrivals = [t for t, _ in a]
    assert arrivals == sorted(arrivals)
    mean_gap = arrivals[-1] / len(arrivals)
    assert 0.2 < mean_gap < 0.3  # ~1/rate
    longs = sum(n == 50 for _, n in a)
    assert 70 < longs < 130  # ~25% of 400
    assert {n for _, n in a} == {5, 50}
    assert build_requests(w, 8.0) != a


def test_prompts_are_unique_from_their_first_block_within_a_run_and_across_runs():
    prompts = Prompts(nonce="a")
    made = [prompts.make(n) for n in [3, 16, 400] * 400]
    assert [len(p) for p in made] == [3, 16, 400] * 400
    assert prompts.issued == 1200
    assert len({tuple(p[: Prompts.HEADER]) for p in made}) == 1200  # no two share a prefix
    assert all(Prompts.FIRST <= t < Prompts.FIRST + Prompts.SPAN for p in made for t in p)
    again, other = Prompts(nonce="a"), Prompts(nonce="b")
    assert [again.make(n) for n in [3, 16, 400]] == made[:3]  # the nonce reproduces a run
    first_a, first_b = Prompts(nonce="a").make(32), other.make(32)
    assert first_a[: Prompts.HEADER] == first_b[: Prompts.HEADER]  # serial 0 in both runs
    assert first_a[Prompts.HEADER :] != first_b[Prompts.HEADER :]  # the rest is the run's own
    assert Prompts().nonce != Prompts().nonce  # a fresh nonce per run by default
    with pytest.raises(ValueError, match="at least 3 tokens"):
        prompts.make(2)


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


def _row(deployment, phase="poisson", rate=1.0, connector=None):
    return RateResult(
        deployment, rate, 10.0, 10, 0, {"p50": 1, "p90": 2, "p99": 3, "mean": 1},
        {"p50": 1, "p90": 2, "p99": 3, "mean": 1}, 10, 1.0, phase=phase, connector=connector,
    )  # fmt: skip


def test_the_table_has_a_connector_column_only_with_several_stacks_and_seq_rows():
    plain = format_table([_row("P/D", "sequential", 0.0), _row("P/D")], 500, 50).splitlines()
    assert plain[1].split()[0] == "deployment"
    assert plain[2].split()[:2] == ["P/D", "seq"] and plain[3].split()[:2] == ["P/D", "1"]
    rows = [
        _row(d, phase, rate, connector)
        for connector in ("pdext over tcp", "nixl")
        for phase, rate in (("sequential", 0.0), ("poisson", 2.0))
        for d in ("colocated", "P/D")
    ]
    table = format_table(rows, 500, 50).splitlines()
    assert table[1].split()[:2] == ["connector", "deployment"]
    expected = [
        f"{c:<19} {d:<11} {rate:>5} "
        for c in ("pdext over tcp", "nixl")
        for rate in ("seq", "2")
        for d in ("colocated", "P/D")
    ]
    assert len(table) == 2 + len(expected)
    assert [line[: len(head)] for line, head in zip(table[2:], expected, strict=True)] == expected


def test_the_plot_draws_one_line_per_deployment_and_connector(tmp_path):
    rows = [
        _row(d, "poisson", r, c) for c in ("a", "b") for d in ("P/D", "colocated") for r in (1, 2)
    ]
    rows.append(_row("P/D", "sequential", 0.0, "a"))
    png = tmp_path / "out.png"
    plot_results(rows, png, "t")
    assert png.read_bytes()[:4] == b"\x89PNG"


def _bench_args(*argv: str):
    return build_parser().parse_args(["bench", *argv])


def bench_stack_configs(args):
    """The stacks ``vllm-pd bench`` would bring up for its parsed ``args``."""
    connectors = args.connector.split(",") if args.connector else None
    return stack_configs(args.config, connectors, args.pdext_backend)


def test_bench_up_builds_one_stack_per_connector_from_the_config(tmp_path):
    args = _bench_args(
        "--up", "--connector", "pdext,nixl", "--pdext-backend", "mooncake",
        "--config", str(EXAMPLES / "up-cpu.yaml"), "--sequential", "5",
    )  # fmt: skip
    assert args.sequential == 5
    pdext, nixl = bench_stack_configs(args)
    assert (pdext.connector, pdext.pdext_backend, nixl.connector) == ("pdext", "mooncake", "nixl")
    assert (pdext.connector_label, nixl.connector_label) == ("pdext over mooncake", "nixl")
    for config in (pdext, nixl):
        assert config.min_split_prompt_tokens == 64  # the file's
        assert config.cost_model is False  # the split path is what is measured
        assert config.log_dir == Path("logs/bench") / config.connector
    assert pdext.proxy_port == nixl.proxy_port == 8000  # picked when each stack starts


def test_bench_up_keeps_the_cost_model_on_only_when_asked():
    pdext, nixl = stack_configs(EXAMPLES / "up-cpu.yaml", ["pdext", "nixl"], None, cost_model=True)
    assert pdext.cost_model is nixl.cost_model is True  # the proxy decides as the main job's


def test_bench_up_without_connector_keeps_its_one_default_stack():
    (config,) = bench_stack_configs(_bench_args("--up"))
    assert (config.connector, config.pdext_backend) == ("pdext", "tcp")
    assert (config.min_split_prompt_tokens, config.cost_model) == (0, False)
    assert config.log_dir == Path("logs/bench")
    assert _bench_args("--up").sequential == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--up", "--connector", "pdext,pdext"], "distinct names"),
        (["--up", "--connector", "nixl,mystery"], "unknown connector 'mystery'"),
        (["--up", "--pdext-backend", "carrier-pigeon"], "unknown pdext_backend"),
        ([*ENDPOINTS, "--connector", "nixl"], "--connector only with --up"),
        ([*ENDPOINTS, "--pdext-backend", "tcp"], "--pdext-backend only with --up"),
        (["--up", "--rates", ""], "give --rates or --sequential"),
        (["--up", "--rates", "1,x"], "could not convert"),
    ],
)  # fmt: skip
def test_bench_refuses_bad_arguments_before_starting_anything(argv, message, capsys):
    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_bench_rejects_a_negative_sequential_count(capsys):
    with pytest.raises(SystemExit):
        _bench_args("--sequential", "-1")
    assert "must be 0 or more" in capsys.readouterr().err
