"""P/D never worse than colocated: ``vllm-pd bench --up`` over our connector and NIXL.

One run of :mod:`vllm_pd_ext.tools.bench` with the stack of ``--config`` (default
``examples/up-cpu.yaml``: tiny-llama, one prefill and one decode ``vllm serve`` on CPU, the
proxy with its defaults, stall guard included; the bench turns the cost model off so every
prompt above ``min_split_prompt_tokens`` is split, unless ``--cost-model``: then the proxy
decides as the main job's does, colocated where the measured transfer costs more than the
stall it would spare), once per connector in ``--connectors``
(default ``pdext,nixl``: our connector over its ``tcp`` backend, then vLLM's NixlConnector).
On each stack, colocated (its decode instance alone) and P/D (its proxy) take the same
workload:

* ``--sequential`` requests of ``--long-tokens`` one at a time, the two endpoints taking
  turns; each P/D request's decision and fallback read from the proxy's counters right after
  it;
* for each of ``--rates``, ``--requests`` Poisson arrivals (``--long-fraction`` long prompts,
  the rest ``--short-tokens``), streaming.

Every prompt of the run is unique (no prefix-cache help across requests, endpoints or
stacks). The JSON holds the date, the commit, the machine with its load at start and end,
every request's figures, each proxy's fallbacks, decisions and open breakers at the end, how
each part's ``/metrics`` grew during the measurement (NIXL's transfer counters, where the
engines' prompt tokens came from, the engines' TTFT and queueing, the proxy's histograms), and
the issue's targets checked against the figures (``targets``): our connector with no stall
and P/D goodput at least colocated's; NIXL behind the stall guard with p99 TTFT within 2x
colocated's, every stalled request served by a fallback, the fallbacks counted in the proxy's
``/metrics``.

Another job's engines on the same cores would skew the stacks differently, so the run refuses
to start while any ``vllm serve`` is running; run it under the lock the integration tests take:

    flock /tmp/vllm-serve.lock env PYTHONPATH=$PWD .venv/bin/python benchmarks/pd_never_worse.py
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import signal
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
from pd_backends import REPO, git, machine, vllm_serve_processes

from vllm_pd_ext.tools.bench import (
    FALLBACKS,
    SEQUENTIAL,
    STALL_FACTOR,
    Prompts,
    RateResult,
    RunStart,
    Workload,
    format_table,
    measure_stacks,
    stack_configs,
    up_stack,
)
from vllm_pd_ext.tools.launcher import UpConfig
from vllm_pd_ext.util.prom import parse_metrics

#: NIXL behind the guard: P/D p99 TTFT at most this many times colocated's (same stack, phase).
NIXL_P99_BOUND = 2.0
#: The samples of each part's ``/metrics`` whose growth over a stack's measurement is
#: recorded (where the time of a slow split went): NIXL's transfer counters and histograms,
#: where the engines' prompt tokens came from, the engines' own TTFT and queueing, and the
#: proxy's.
DIAGNOSTIC_PREFIXES = (
    "vllm:nixl_",
    "vllm:prompt_tokens_by_source",
    "vllm:time_to_first_token_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:num_preemptions",
    "vllm_pd_",
)


def diagnostic_samples(url: str) -> dict[str, float]:
    """``name{labels}`` -> value of the ``DIAGNOSTIC_PREFIXES`` samples at ``url`` (labels
    naming the engine or model left out); empty when ``/metrics`` cannot be read."""
    try:
        metrics = parse_metrics(httpx.get(f"{url}/metrics", timeout=30).text)
    except (httpx.HTTPError, ValueError):
        return {}
    out: dict[str, float] = {}
    for sample in metrics.samples:
        if sample.name.startswith(DIAGNOSTIC_PREFIXES) and not sample.name.endswith("_created"):
            labels = ",".join(
                f"{k}={v}" for k, v in sample.labels if k not in ("engine", "model_name")
            )
            key = f"{sample.name}{{{labels}}}" if labels else sample.name
            out[key] = out.get(key, 0.0) + sample.value
    return out


def grew(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: round(v - before.get(k, 0.0), 6) for k, v in after.items() if v != before.get(k)}


#: Per stack label: each part's diagnostic samples' growth over the measurement.
DIAGNOSTICS: dict[str, dict[str, dict[str, float]]] = {}


@contextmanager
def diagnosed_stack(config: UpConfig) -> Iterator[tuple[str, str, str]]:
    """:func:`up_stack`, recording into ``DIAGNOSTICS`` how each part's diagnostic samples
    grew from after the warm-up to the end of the measurement."""
    with up_stack(config) as (colocated, pd, model):
        proxy_config = json.loads((config.log_dir / "proxy.json").read_text())
        parts = {i["name"]: i["url"] for i in proxy_config["instances"]} | {"proxy": pd}
        before = {name: diagnostic_samples(url) for name, url in parts.items()}
        yield colocated, pd, model
        DIAGNOSTICS[config.connector_label] = {
            name: grew(before[name], diagnostic_samples(url)) for name, url in parts.items()
        }


def stalled(row: RateResult) -> list[dict[str, Any]]:
    """The answered requests of ``row`` whose TTFT was over ``STALL_FACTOR`` times the
    row's median TTFT (the bench's stalls), with their records."""
    ok = [r["ttft_ms"] for r in row.requests if r["ok"]]
    if not ok:
        return []
    median = statistics.median(ok)
    return [r for r in row.requests if r["ok"] and r["ttft_ms"] > STALL_FACTOR * median]


def phase_key(row: RateResult) -> str:
    return "sequential" if row.phase == SEQUENTIAL else f"{row.rate:g} req/s"


def summarize(results: list[RateResult]) -> dict[str, Any]:
    """Per connector and phase: P/D against colocated (TTFT p50/p99, goodput, stalls,
    fallbacks), and for the sequential phase every stalled P/D request with how it was
    served."""
    out: dict[str, Any] = {}
    for row in results:
        if row.deployment != "P/D":
            continue
        colocated = next(
            r
            for r in results
            if r.connector == row.connector
            and r.deployment == "colocated"
            and (r.phase, r.rate) == (row.phase, row.rate)
        )
        phase: dict[str, Any] = {
            "requests": row.completed + row.failed,
            "failed": {"P/D": row.failed, "colocated": colocated.failed},
            "ttft_p50_ms": {"P/D": row.ttft_ms["p50"], "colocated": colocated.ttft_ms["p50"]},
            "ttft_p99_ms": {"P/D": row.ttft_ms["p99"], "colocated": colocated.ttft_ms["p99"]},
            "ttft_p99_ratio": round(row.ttft_ms["p99"] / colocated.ttft_ms["p99"], 3)
            if colocated.ttft_ms["p99"]
            else None,
            "goodput_rps": {"P/D": row.goodput_rps, "colocated": colocated.goodput_rps},
            "slo_attained": {"P/D": row.slo_attained, "colocated": colocated.slo_attained},
            "stalls": {"P/D": row.stalls, "colocated": colocated.stalls},
            "fallbacks": row.fallbacks,
            "decisions": row.decisions,
        }
        if row.phase == SEQUENTIAL:
            phase["stalled_pd_requests"] = [
                {"ttft_ms": r["ttft_ms"], "served": r.get("served", "")} for r in stalled(row)
            ]
        out.setdefault(row.connector or "", {})[phase_key(row)] = phase
    return out


def check_targets(
    summary: dict[str, Any], stacks: dict[str, dict[str, Any]], ours: str, nixl: str
) -> dict[str, Any]:
    """The issue's targets against the figures; each ``{"met": bool, ...figures}``."""
    targets: dict[str, Any] = {}
    if ours in summary:
        phases = summary[ours]
        targets["ours_zero_stalls"] = {
            "met": all(p["stalls"]["P/D"] == 0 for p in phases.values()),
            "stalls_by_phase": {k: p["stalls"]["P/D"] for k, p in phases.items()},
        }
        poisson = {k: p for k, p in phases.items() if k != "sequential"}
        targets["ours_pd_goodput_at_least_colocated"] = {
            "met": all(
                p["slo_attained"]["P/D"] >= p["slo_attained"]["colocated"] for p in poisson.values()
            ),
            "slo_attained_by_rate": {k: p["slo_attained"] for k, p in poisson.items()},
            "goodput_rps_by_rate": {k: p["goodput_rps"] for k, p in poisson.items()},
            "note": "per Poisson rate, the same arrivals and prompt lengths for both: the "
            "requests that met the SLO (goodput's numerator); goodput_rps also divides by "
            "each run's duration, which ends with its last answer",
        }
    if nixl in summary:
        phases = summary[nixl]
        ratios = {k: p["ttft_p99_ratio"] for k, p in phases.items()}
        targets["nixl_p99_ttft_within_2x_colocated"] = {
            "met": all(r is not None and r <= NIXL_P99_BOUND for r in ratios.values()),
            "ratio_by_phase": ratios,
        }
        seq = phases.get("sequential", {}).get("stalled_pd_requests", [])
        uncaught = [r for r in seq if "fallback" not in r["served"]]
        poisson = {
            k: {
                "stalls": p["stalls"]["P/D"],
                "stall_fallbacks": (p["fallbacks"] or {}).get("stall", 0),
            }
            for k, p in phases.items()
            if k != "sequential"
        }
        targets["nixl_every_stall_served_by_fallback"] = {
            "met": not uncaught
            and all(v["stalls"] <= v["stall_fallbacks"] for v in poisson.values()),
            "sequential_stalled": len(seq),
            "sequential_stalled_without_fallback": uncaught,
            "poisson_stalls_vs_stall_fallbacks": poisson,
            "note": "sequential: per request (the proxy's counters read after each); "
            "Poisson: counts only (requests overlap)",
        }
        counted = (stacks[nixl].get("proxy_counters_at_end") or {}).get(FALLBACKS, {})
        measured = sum((p["fallbacks"] or {}).get("stall", 0) for p in phases.values())
        targets["nixl_fallbacks_in_metrics"] = {
            "met": counted.get("stall", 0) >= measured,
            "proxy_metrics_at_end": counted,
            "stall_fallbacks_during_phases": measured,
        }
    return targets


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=REPO / "examples" / "up-cpu.yaml")
    ap.add_argument("--connectors", default="pdext,nixl", help="stacks, in this order")
    ap.add_argument("--sequential", type=int, default=100)
    ap.add_argument("--rates", default="1,2,4")
    ap.add_argument("--requests", type=int, default=40, help="requests per rate")
    ap.add_argument("--long-fraction", type=float, default=0.5)
    ap.add_argument("--long-tokens", type=int, default=300)
    ap.add_argument("--short-tokens", type=int, default=32)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    ap.add_argument("--slo-itl-ms", type=float, default=100.0)
    ap.add_argument(
        "--cost-model",
        action="store_true",
        help="keep the proxy's cost model on, as the main job has it (default: off, every "
        "long prompt split)",
    )
    ap.add_argument(
        "--out", type=Path, default=REPO / "benchmarks" / "results" / "pd_never_worse.json"
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stacks stop in their finally
    strays = vllm_serve_processes()
    if strays:
        print("vllm serve is already running; measure on a quiet host:", *strays, sep="\n  ")
        return 1
    connectors = args.connectors.split(",")
    configs = stack_configs(args.config, connectors, None, cost_model=args.cost_model)
    limit = (configs[0].max_model_len or 4096) - args.output_tokens
    if not configs[0].min_split_prompt_tokens < args.long_tokens <= limit:
        print(f"--long-tokens must be above min_split_prompt_tokens and at most {limit}")
        return 2
    workload = Workload(
        rates=tuple(float(r) for r in args.rates.split(",") if r),
        requests_per_rate=args.requests,
        sequential=args.sequential,
        long_fraction=args.long_fraction,
        long_tokens=args.long_tokens,
        short_tokens=args.short_tokens,
        output_tokens=args.output_tokens,
    )
    prompts = Prompts()
    started = RunStart.now()
    wall = time.monotonic()
    model, stacks, results = measure_stacks(
        configs,
        workload,
        args.slo_ttft_ms,
        args.slo_itl_ms,
        prompts,
        label_rows=True,
        bring_up=diagnosed_stack,
    )
    left = vllm_serve_processes()
    labels = [c.connector_label for c in configs]
    ours = next((c.connector_label for c in configs if c.connector == "pdext"), "")
    nixl = next((c.connector_label for c in configs if c.connector == "nixl"), "")
    summary = summarize(results)
    meta = started.meta(model, workload, prompts)

    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    result = {
        "benchmark": "pd_never_worse",
        "date": meta["date"],
        "git_commit": git("rev-parse", "--short", "HEAD"),
        "uncommitted_in_vllm_pd_ext": git(
            "status", "--porcelain", "--", "vllm_pd_ext"
        ).splitlines(),
        "machine": {
            **machine(),
            "nixl": version("nixl"),
            "loadavg_at_start": meta["host"]["loadavg_at_start"],
            "loadavg_at_end": list(os.getloadavg()),
            "vllm_serve_before": strays,
            "vllm_serve_after": left,
        },
        "wall_s": round(time.monotonic() - wall, 1),
        "config": str(
            args.config.relative_to(REPO) if args.config.is_relative_to(REPO) else args.config
        ),
        "connectors": labels,
        "cost_model": args.cost_model,
        "model": model,
        "workload": meta["workload"],
        "slo": {"ttft_ms": args.slo_ttft_ms, "itl_ms": args.slo_itl_ms},
        "stall_factor": STALL_FACTOR,
        "prompt_nonce": prompts.nonce,
        "prompts_issued": prompts.issued,
        "targets": check_targets(summary, stacks, ours, nixl),
        "summary": summary,
        "stacks": stacks,
        "metrics_growth_during_measurement": DIAGNOSTICS,
        "results": [asdict(r) for r in results],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(format_table(results, args.slo_ttft_ms, args.slo_itl_ms))
    for name, target in result["targets"].items():
        print(f"{name}: {'met' if target['met'] else 'NOT met'}")
    load = result["machine"]
    print(f"load {load['loadavg_at_start'][0]:.2f} -> {load['loadavg_at_end'][0]:.2f}")
    print(f"wrote {args.out}")
    if left:
        print("vllm serve left running after the run:", *left, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
