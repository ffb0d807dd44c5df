"""``vllm-pd bench`` against the real proxy over fake engines: what it reports of stalls and
of the proxy's fallbacks."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import contextmanager

from tests.unit.proxy.helpers import fleet, proxy
from vllm_pd_ext.tools.bench import Prompts, Workload, bench_up_main, run_bench, run_rate
from vllm_pd_ext.tools.launcher import UpConfig


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


def _sent_prompts(engines) -> list[tuple[int, ...]]:
    """Every prompt the engines were sent, one per request (a split's two legs are one)."""
    seen = []
    for engine in engines.values():
        for r in engine.requests:
            params = r["body"].get("kv_transfer_params") or {}
            if not params.get("do_remote_prefill"):  # a decode leg repeats its prefill's
                seen.append(tuple(r["body"]["prompt"]))
    return seen


def test_sequential_turns_record_how_the_proxy_served_each_request(engines):
    """One request at a time, the endpoints taking turns: each split through the proxy
    stalls and is served colocated, and each request's record says so; the engine alone
    has no proxy counters to read."""
    engines["d1"].behavior.kv_stall_s = 600.0
    workload = Workload(rates=(), sequential=3, long_tokens=300, output_tokens=4)
    guard = {"floor_s": 0.3, "breaker_stalls": 100}
    one_pair = fleet(engines, prefill=("p1",), decode=("d1",))
    with proxy(engines, instances=one_pair, stall_guard=guard) as (base, _):
        targets = {"colocated": engines["d2"].url, "P/D": base}
        colocated, pd = asyncio.run(run_bench(targets, "m", workload, 1e6, 1e6, Prompts()))
    assert (pd.deployment, pd.phase, pd.rate, pd.completed) == ("P/D", "sequential", 0.0, 3)
    assert pd.fallbacks == {"stall": 3.0} and pd.decisions == {"split/split": 3.0}
    assert [r["served"] for r in pd.requests] == ["split/split + fallback stall"] * 3
    assert colocated.phase == "sequential" and colocated.completed == 3
    assert all("served" not in r for r in colocated.requests)
    # the turns alternate which endpoint goes first
    order = sorted((r["sent_s"], d.deployment) for d in (colocated, pd) for r in d.requests)
    assert [d for _, d in order] == ["colocated", "P/D", "P/D", "colocated", "colocated", "P/D"]
    assert all(r["prompt_tokens"] == 300 and r["tokens"] == 4 for r in pd.requests)


def test_every_request_of_a_run_has_its_own_prompt_across_phases_and_endpoints(engines):
    workload = Workload(
        rates=(20.0, 40.0), requests_per_rate=4, sequential=2, long_fraction=0.5,
        long_tokens=300, short_tokens=8, output_tokens=2,
    )  # fmt: skip
    one_pair = fleet(engines, prefill=("p1",), decode=("d1",))
    with proxy(engines, instances=one_pair) as (base, _):
        targets = {"colocated": engines["d2"].url, "P/D": base}
        rows = asyncio.run(run_bench(targets, "m", workload, 1e6, 1e6, Prompts()))
    assert [(r.deployment, r.phase, r.rate) for r in rows] == [
        ("colocated", "sequential", 0.0), ("P/D", "sequential", 0.0),
        ("colocated", "poisson", 20.0), ("P/D", "poisson", 20.0),
        ("colocated", "poisson", 40.0), ("P/D", "poisson", 40.0),
    ]  # fmt: skip
    assert sum(r.completed for r in rows) == 2 * (2 + 4 + 4)
    for row in rows:  # Poisson requests say when they were due, sequential ones do not
        if row.phase == "poisson":
            assert all(r["sent_s"] >= r["due_s"] for r in row.requests)
        else:
            assert all("due_s" not in r for r in row.requests)
    sent = _sent_prompts(engines)
    assert len(sent) == 20 and len(set(sent)) == 20
    assert len({p[: Prompts.HEADER] for p in sent}) == 20  # not even a first block shared


def test_bench_up_with_two_connectors_writes_one_table_and_json(engines, tmp_path, capsys):
    """``--up --connector pdext,nixl`` without engines: each "stack" is the proxy over the
    fake engines. One JSON: rows per connector (sequential, then each rate; colocated and
    P/D), each stack's targets and its proxy's counters at the end."""
    engines["d1"].behavior.kv_stall_s = 600.0
    one_pair = fleet(engines, prefill=("p1",), decode=("d1",))
    guard = {"floor_s": 0.3, "breaker_stalls": 100}

    @contextmanager
    def fake_stack(config: UpConfig) -> Iterator[tuple[str, str, str]]:
        with proxy(engines, instances=one_pair, stall_guard=guard) as (base, _):
            yield engines["d2"].url, base, "m"

    configs = [UpConfig(connector="pdext", cost_model=False), UpConfig(connector="nixl")]
    workload = Workload(
        rates=(20.0,), requests_per_rate=2, sequential=2, long_fraction=1.0, long_tokens=300,
        output_tokens=2,
    )  # fmt: skip
    out = tmp_path / "bench.json"
    status = bench_up_main(
        configs, workload, 1e6, 1e6, out, None, label_rows=True, bring_up=fake_stack
    )
    assert status == 0
    data = json.loads(out.read_text())
    keys = [(r["connector"], r["phase"], r["deployment"]) for r in data["results"]]
    assert keys == [
        (c, phase, d)
        for c in ("pdext over tcp", "nixl")
        for phase in ("sequential", "poisson")
        for d in ("colocated", "P/D")
    ]
    assert all(len(r["requests"]) == 2 for r in data["results"])
    assert set(data["stacks"]) == {"pdext over tcp", "nixl"}
    for stack in data["stacks"].values():
        assert stack["targets"]["colocated"] == engines["d2"].url
        counters = stack["proxy_counters_at_end"]
        assert counters["vllm_pd_fallbacks_total"] == {"stall": 4.0}  # 2 sequential, 2 Poisson
        assert counters["vllm_pd_breaker_open"] == {}
    assert data["prompts_issued"] == 2 * (2 * 2 + 2 * 2)
    assert data["date"] and data["host"]["cpus"] and "targets" not in data
    table = capsys.readouterr().out
    assert table.count("nixl ") == 4 and table.count("pdext over tcp ") == 4
