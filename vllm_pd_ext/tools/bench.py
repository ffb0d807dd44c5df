"""``vllm-pd bench``: goodput of colocated vs disaggregated serving on the same workload.

For each request rate, the same seeded workload (Poisson arrivals, a mix of long and short
prompts, streaming) runs against the colocated endpoint and the P/D endpoint, one after the
other. Reports TTFT and ITL percentiles and goodput (requests per second that met both SLOs:
TTFT <= ``slo_ttft_ms`` and mean inter-token latency <= ``slo_itl_ms``), as a table, JSON and a
PNG of p99 ITL and goodput against request rate (the chart vLLM's disaggregation guide draws).
Also per rate: stalls (answered requests whose TTFT was over ``STALL_FACTOR`` times the
median's) and, where the endpoint is our proxy, its fallbacks by reason
(``vllm_pd_fallbacks_total`` before and after).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from vllm_pd_ext.util.prom import parse_metrics

#: A request whose TTFT is over this many times its run's median TTFT counts as a stall.
STALL_FACTOR = 10.0
#: The proxy's fallback counter (by ``reason``).
FALLBACKS = "vllm_pd_fallbacks_total"


@dataclass(frozen=True)
class Workload:
    rates: tuple[float, ...] = (1.0, 2.0, 4.0)
    requests_per_rate: int = 20
    long_fraction: float = 0.3
    long_tokens: int = 400
    short_tokens: int = 32
    output_tokens: int = 32
    seed: int = 0
    timeout_s: float = 120.0


@dataclass
class Sample:
    ok: bool
    ttft_s: float = 0.0
    itls_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    error: str = ""

    @property
    def mean_itl_s(self) -> float:
        return statistics.mean(self.itls_s) if self.itls_s else 0.0


@dataclass
class RateResult:
    deployment: str
    rate: float
    duration_s: float
    completed: int
    failed: int
    ttft_ms: dict[str, float]
    itl_ms: dict[str, float]
    slo_attained: int
    goodput_rps: float
    stalls: int = 0
    #: The proxy's fallbacks during the run, by reason (empty: none, or not our proxy; None:
    #: its metrics could not be read).
    fallbacks: dict[str, float] | None = field(default_factory=dict)


def percentiles(values: list[float], scale: float = 1e3) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] * scale

    return {
        "p50": pick(0.5),
        "p90": pick(0.9),
        "p99": pick(0.99),
        "mean": statistics.mean(ordered) * scale,
    }


def slo_attained(samples: list[Sample], slo_ttft_ms: float, slo_itl_ms: float) -> int:
    """Answered requests whose TTFT and mean inter-token latency are both within the SLO."""
    return sum(
        1
        for s in samples
        if s.ok and s.ttft_s * 1e3 <= slo_ttft_ms and s.mean_itl_s * 1e3 <= slo_itl_ms
    )


def stalls(samples: list[Sample]) -> int:
    """Answered requests whose TTFT was over ``STALL_FACTOR`` times the median's."""
    ttfts = [s.ttft_s for s in samples if s.ok]
    if not ttfts:
        return 0
    limit = STALL_FACTOR * statistics.median(ttfts)
    return sum(t > limit for t in ttfts)


async def fallback_counts(client: httpx.AsyncClient, url: str) -> dict[str, float] | None:
    """The proxy's fallbacks so far by reason (empty: an endpoint without them, e.g. an
    engine); None when its ``/metrics`` cannot be read (unreachable, a token needed, not
    Prometheus text)."""
    try:
        resp = await client.get(f"{url}/metrics")
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    try:
        return parse_metrics(resp.text).by_label(FALLBACKS, "reason")
    except ValueError:
        return None


def build_requests(workload: Workload, rate: float) -> list[tuple[float, list[int]]]:
    """(arrival offset in seconds, prompt token ids) for one rate, seeded and reproducible."""
    rng = random.Random(f"{workload.seed}-{rate}")
    at = 0.0
    out = []
    for i in range(workload.requests_per_rate):
        at += rng.expovariate(rate)
        long = rng.random() < workload.long_fraction
        n = workload.long_tokens if long else workload.short_tokens
        out.append((at, [100 + (i * 31 + j * 7) % 900 for j in range(n)]))
    return out


async def one_request(
    client: httpx.AsyncClient, url: str, model: str, prompt: list[int], output_tokens: int
) -> Sample:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    start = time.perf_counter()
    sample = Sample(ok=False, prompt_tokens=len(prompt))
    last: float | None = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                sample.error = f"HTTP {resp.status_code}"
                return sample
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    sample.error = str(chunk["error"])[:200]
                    return sample
                n = sum(len(c.get("token_ids") or []) for c in chunk.get("choices", []))
                if n == 0:
                    continue
                if last is None:
                    sample.ttft_s = now - start
                    n -= 1  # the first token's gap is the TTFT
                if n > 0 and last is not None:
                    sample.itls_s.extend([(now - last) / n] * n)  # coalesced tokens
                last = now
        sample.ok = last is not None
    except httpx.HTTPError as exc:
        sample.error = type(exc).__name__
    return sample


def _progress(done: int, total: int, label: str) -> None:
    width = 30
    filled = int(width * done / max(1, total))
    print(
        f"\r  {label:<28} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}",
        end="",
        file=sys.stderr,
        flush=True,
    )
    if done == total:
        print(file=sys.stderr, flush=True)


async def run_rate(
    url: str,
    model: str,
    deployment: str,
    rate: float,
    workload: Workload,
    slo_ttft_ms: float,
    slo_itl_ms: float,
) -> RateResult:
    plan = build_requests(workload, rate)
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    async with httpx.AsyncClient(
        timeout=workload.timeout_s, limits=limits, trust_env=False
    ) as client:
        before = await fallback_counts(client, url)
        start = time.perf_counter()
        done = 0

        async def fire(at: float, prompt: list[int]) -> Sample:
            nonlocal done
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            sample = await one_request(client, url, model, prompt, workload.output_tokens)
            done += 1
            _progress(done, len(plan), f"{deployment} @ {rate:g} req/s")
            return sample

        samples = await asyncio.gather(*(fire(at, p) for at, p in plan))
        duration = time.perf_counter() - start
        after = await fallback_counts(client, url)
    fallbacks = None
    if before is not None and after is not None:
        fallbacks = {r: n - before.get(r, 0.0) for r, n in after.items() if n > before.get(r, 0.0)}
    good = [s for s in samples if s.ok]
    attained = slo_attained(samples, slo_ttft_ms, slo_itl_ms)
    return RateResult(
        deployment=deployment,
        rate=rate,
        duration_s=duration,
        completed=len(good),
        failed=len(samples) - len(good),
        ttft_ms=percentiles([s.ttft_s for s in good]),
        itl_ms=percentiles([i for s in good for i in s.itls_s]),
        slo_attained=attained,
        goodput_rps=attained / duration if duration else 0.0,
        stalls=stalls(samples),
        fallbacks=fallbacks,
    )


async def run_bench(
    targets: dict[str, str], model: str, workload: Workload, slo_ttft_ms: float, slo_itl_ms: float
) -> list[RateResult]:
    results = []
    for rate in workload.rates:
        for deployment, url in targets.items():
            results.append(
                await run_rate(url, model, deployment, rate, workload, slo_ttft_ms, slo_itl_ms)
            )
    return results


def format_table(results: list[RateResult], slo_ttft_ms: float, slo_itl_ms: float) -> str:
    head = (
        f"{'deployment':<11} {'rate':>5} {'ok':>4} {'fail':>4} {'TTFT p50':>9} "
        f"{'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'SLO met':>8} {'goodput':>8} "
        f"{'stalls':>6}  fallbacks"
    )
    lines = [f"SLO: TTFT <= {slo_ttft_ms:g} ms, mean ITL <= {slo_itl_ms:g} ms", head]
    for r in results:
        total = r.completed + r.failed
        lines.append(
            f"{r.deployment:<11} {r.rate:>5g} {r.completed:>4} {r.failed:>4} "
            f"{r.ttft_ms['p50']:>7.1f}ms {r.ttft_ms['p99']:>7.1f}ms {r.itl_ms['p50']:>6.1f}ms "
            f"{r.itl_ms['p99']:>6.1f}ms {r.slo_attained:>4}/{total:<3} {r.goodput_rps:>6.2f}/s "
            f"{r.stalls:>6}  " + _fallbacks_cell(r.fallbacks)
        )
    return "\n".join(lines)


def _fallbacks_cell(fallbacks: dict[str, float] | None) -> str:
    if fallbacks is None:
        return "n/a (metrics unreadable)"
    return ", ".join(f"{k} {v:g}" for k, v in sorted(fallbacks.items())) or "-"


def plot(results: list[RateResult], path: Path, title: str) -> None:
    """p99 ITL and goodput against request rate, one line per deployment."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for deployment in dict.fromkeys(r.deployment for r in results):
        rows = [r for r in results if r.deployment == deployment]
        rates = [r.rate for r in rows]
        left.plot(rates, [r.itl_ms["p99"] for r in rows], marker="o", label=deployment)
        right.plot(rates, [r.goodput_rps for r in rows], marker="o", label=deployment)
    left.set(xlabel="request rate (req/s)", ylabel="p99 ITL (ms)", title="p99 inter-token latency")
    right.set(xlabel="request rate (req/s)", ylabel="goodput (req/s)", title="goodput")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def bench_main(
    colocated: str,
    pd: str,
    model: str | None,
    workload: Workload,
    slo_ttft_ms: float,
    slo_itl_ms: float,
    out_json: Path,
    out_png: Path | None,
    note: str = "",
) -> int:
    targets = {"colocated": colocated.rstrip("/"), "P/D": pd.rstrip("/")}
    if model is None:
        model = httpx.get(f"{targets['P/D']}/v1/models", timeout=10).json()["data"][0]["id"]
    print(
        f"vllm-pd bench: {len(workload.rates)} rates x {workload.requests_per_rate} requests "
        f"x 2 deployments, model {model}",
        file=sys.stderr,
    )
    results = asyncio.run(run_bench(targets, model, workload, slo_ttft_ms, slo_itl_ms))
    print(format_table(results, slo_ttft_ms, slo_itl_ms))
    if note:
        print(note)
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(
        json.dumps(
            {
                "model": model,
                "targets": targets,
                "workload": asdict(workload),
                "slo": {"ttft_ms": slo_ttft_ms, "itl_ms": slo_itl_ms},
                "note": note,
                "results": [asdict(r) for r in results],
            },
            indent=2,
        )
        + "\n"
    )
    print(f"JSON: {out_json}")
    if out_png is not None:
        plot(results, out_png, f"{model}: colocated vs P/D")
        print(f"plot: {out_png}")
    return 0 if all(r.completed for r in results) else 1
