"""``vllm-pd bench``: goodput of colocated vs disaggregated serving on the same workload.

Phases, each run against the colocated endpoint and the P/D endpoint:

* with ``sequential`` N: N long prompts one request at a time, the two endpoints taking turns
  request by request (which one goes first alternates), so the split path's TTFT is measured
  without queueing; where the endpoint is our proxy, each request's decision and fallbacks
  are read from its counters right after it;
* for each request rate: the same seeded arrivals (Poisson) and prompt lengths (a mix of long
  and short), streaming, one endpoint after the other.

Every prompt is unique (:class:`Prompts`): no request is helped by a prefix cache warmed by
another request, endpoint, phase or run. Reports TTFT and ITL percentiles and goodput
(requests per second that met both SLOs: TTFT <= ``slo_ttft_ms`` and mean inter-token latency
<= ``slo_itl_ms``; for a sequential phase, over the time its requests took), as a table, JSON
(with every request's figures) and a PNG of p99 ITL and goodput against request rate (the chart
vLLM's disaggregation guide draws). Also per phase: stalls (answered requests whose TTFT was
over ``STALL_FACTOR`` times the median's) and, where the endpoint is our proxy, its decisions
and fallbacks by reason (``vllm_pd_decisions_total``, ``vllm_pd_fallbacks_total``, before and
after).

With ``--up`` the endpoints are a local stack's (the launcher's :class:`Stack`): colocated is
its decode instance alone, P/D its proxy; with several connectors, one stack per connector in
turn, each measured as above, all rows in one table and one JSON.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import platform
import random
import secrets
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from vllm_pd_ext.util.prom import Metrics, parse_metrics

if TYPE_CHECKING:
    from vllm_pd_ext.tools.launcher import UpConfig

#: A request whose TTFT is over this many times its run's median TTFT counts as a stall.
STALL_FACTOR = 10.0
#: The proxy's counters: fallbacks (by ``reason``) and decisions (by ``decision``, ``reason``).
FALLBACKS = "vllm_pd_fallbacks_total"
DECISIONS = "vllm_pd_decisions_total"
#: The proxy's gauge of a prefill-decode pair whose stall breaker is open.
BREAKER_OPEN = "vllm_pd_breaker_open"
#: A gauge only our proxy exports: an endpoint that has it is our proxy.
PROXY_GAUGE = "vllm_pd_in_flight"
SEQUENTIAL = "sequential"
POISSON = "poisson"


class BenchError(RuntimeError):
    """The bench cannot measure (a stack that did not come up)."""


@dataclass(frozen=True)
class Workload:
    rates: tuple[float, ...] = (1.0, 2.0, 4.0)
    requests_per_rate: int = 20
    #: Requests one after another (each of ``long_tokens``) before the rates; 0: none.
    sequential: int = 0
    long_fraction: float = 0.3
    long_tokens: int = 400
    short_tokens: int = 32
    output_tokens: int = 32
    seed: int = 0
    timeout_s: float = 120.0


class Prompts:
    """Unique prompts for one bench run. Token ids lie in ``[FIRST, FIRST + SPAN)`` (clear of
    the special tokens at either end of a vocabulary of 1,000 or more); the first ``HEADER``
    encode the prompt's serial number in the run, the rest are drawn from a generator seeded
    with the run's ``nonce`` and that number. So no two prompts of a run share a first token
    block, and a run with another nonce shares none with this one: no request is served from
    a prefix cache another request filled."""

    FIRST = 100
    SPAN = 900
    HEADER = 3

    def __init__(self, nonce: str | None = None) -> None:
        self.nonce = nonce if nonce is not None else secrets.token_hex(8)
        self.issued = 0

    def make(self, tokens: int) -> list[int]:
        """A new prompt of ``tokens`` token ids (at least ``HEADER``)."""
        if tokens < self.HEADER:
            raise ValueError(f"a prompt needs at least {self.HEADER} tokens to be unique")
        serial = self.issued
        if serial >= self.SPAN**self.HEADER:
            raise ValueError("out of unique prompt numbers")
        self.issued += 1
        head = [self.FIRST + serial // self.SPAN**k % self.SPAN for k in range(self.HEADER)]
        rng = random.Random(f"{self.nonce}-{serial}")
        return head + [self.FIRST + rng.randrange(self.SPAN) for _ in range(tokens - self.HEADER)]


@dataclass
class Sample:
    ok: bool
    ttft_s: float = 0.0
    itls_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    error: str = ""
    #: Tokens received.
    tokens: int = 0
    #: When it was sent, in seconds from its phase's start.
    sent_s: float = 0.0
    #: When it was due (its Poisson arrival), in seconds from its phase's start; None in a
    #: sequential phase. A ``sent_s`` well past it: the client fell behind.
    due_s: float | None = None
    #: How our proxy served it (``decision/reason``, ``+ fallback REASON``); "" unknown.
    served: str = ""

    @property
    def mean_itl_s(self) -> float:
        return statistics.mean(self.itls_s) if self.itls_s else 0.0

    def record(self) -> dict[str, Any]:
        """This request's figures, for the JSON."""
        out: dict[str, Any] = {
            "sent_s": round(self.sent_s, 4),
            **({"due_s": round(self.due_s, 4)} if self.due_s is not None else {}),
            "prompt_tokens": self.prompt_tokens,
            "ok": self.ok,
            "ttft_ms": round(self.ttft_s * 1e3, 2),
            "mean_itl_ms": round(self.mean_itl_s * 1e3, 3),
            "tokens": self.tokens,
        }
        if self.served:
            out["served"] = self.served
        if self.error:
            out["error"] = self.error
        return out


@dataclass
class RateResult:
    deployment: str
    rate: float  # 0.0 in a sequential phase
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
    #: ``poisson`` (arrivals at ``rate``) or ``sequential`` (one request at a time).
    phase: str = POISSON
    #: The stack's connector under ``--up --connector``; None otherwise.
    connector: str | None = None
    #: The proxy's decisions during the run by ``decision/reason`` (as ``fallbacks``).
    decisions: dict[str, float] | None = field(default_factory=dict)
    #: Every request's figures (:meth:`Sample.record`), in the order they were sent.
    requests: list[dict[str, Any]] = field(default_factory=list)


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


async def proxy_metrics(client: httpx.AsyncClient, url: str) -> Metrics | None:
    """The endpoint's ``/metrics``; None when they cannot be read (unreachable, a token
    needed, not Prometheus text)."""
    try:
        resp = await client.get(f"{url}/metrics")
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    try:
        return parse_metrics(resp.text)
    except ValueError:
        return None


def counter_delta(
    before: Metrics | None, after: Metrics | None, name: str, *labels: str
) -> dict[str, float] | None:
    """How much counter ``name`` grew by ``labels`` between two scrapes (only what grew);
    None when either scrape failed."""
    if before is None or after is None:
        return None
    old = before.by_label(name, *labels)
    return {
        k: v - old.get(k, 0.0)
        for k, v in after.by_label(name, *labels).items()
        if v > old.get(k, 0.0)
    }


def served_label(before: Metrics | None, after: Metrics | None) -> str:
    """How the proxy served the one request between two scrapes: its decision
    (``decision/reason``) and any fallback (``+ fallback REASON``); "" when unknown."""
    decisions = counter_delta(before, after, DECISIONS, "decision", "reason")
    fallbacks = counter_delta(before, after, FALLBACKS, "reason")
    if not decisions and not fallbacks:
        return ""
    label = "+".join(sorted(decisions or {}))
    if fallbacks:
        label += " + fallback " + "+".join(sorted(fallbacks))
    return label


def build_requests(workload: Workload, rate: float) -> list[tuple[float, int]]:
    """(arrival offset in seconds, prompt tokens) for one rate, seeded and reproducible."""
    rng = random.Random(f"{workload.seed}-{rate}")
    at = 0.0
    out = []
    for _ in range(workload.requests_per_rate):
        at += rng.expovariate(rate)
        long = rng.random() < workload.long_fraction
        out.append((at, workload.long_tokens if long else workload.short_tokens))
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
                sample.tokens += n
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
        f"\r  {label:<34} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}",
        end="",
        file=sys.stderr,
        flush=True,
    )
    if done == total:
        print(file=sys.stderr, flush=True)


def _client(workload: Workload) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    return httpx.AsyncClient(timeout=workload.timeout_s, limits=limits, trust_env=False)


def _result(
    deployment: str,
    phase: str,
    rate: float,
    duration: float,
    samples: list[Sample],
    before: Metrics | None,
    after: Metrics | None,
    slo_ttft_ms: float,
    slo_itl_ms: float,
) -> RateResult:
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
        fallbacks=counter_delta(before, after, FALLBACKS, "reason"),
        phase=phase,
        decisions=counter_delta(before, after, DECISIONS, "decision", "reason"),
        requests=[s.record() for s in samples],
    )


async def run_rate(
    url: str,
    model: str,
    deployment: str,
    rate: float,
    workload: Workload,
    slo_ttft_ms: float,
    slo_itl_ms: float,
    prompts: Prompts | None = None,
) -> RateResult:
    """One endpoint at one Poisson rate; ``prompts`` makes the run's unique prompts (a fresh
    :class:`Prompts` when None)."""
    prompts = prompts or Prompts()
    plan = [(at, prompts.make(n)) for at, n in build_requests(workload, rate)]
    async with _client(workload) as client:
        before = await proxy_metrics(client, url)
        start = time.perf_counter()
        done = 0

        async def fire(at: float, prompt: list[int]) -> Sample:
            nonlocal done
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            sent = time.perf_counter() - start
            sample = await one_request(client, url, model, prompt, workload.output_tokens)
            sample.sent_s, sample.due_s = sent, at
            done += 1
            _progress(done, len(plan), f"{deployment} @ {rate:g} req/s")
            return sample

        samples = await asyncio.gather(*(fire(at, p) for at, p in plan))
        duration = time.perf_counter() - start
        after = await proxy_metrics(client, url)
    return _result(
        deployment, POISSON, rate, duration, samples, before, after, slo_ttft_ms, slo_itl_ms
    )


async def run_sequential(
    targets: dict[str, str],
    model: str,
    workload: Workload,
    slo_ttft_ms: float,
    slo_itl_ms: float,
    prompts: Prompts,
) -> list[RateResult]:
    """``workload.sequential`` prompts of ``long_tokens`` per endpoint, one request at a time,
    the endpoints taking turns request by request (the first of each turn alternating). An
    endpoint's duration is the time its own requests took. Where an endpoint is our proxy,
    each request's decision and fallbacks come from its counters just before and after."""
    names = list(targets)
    samples: dict[str, list[Sample]] = {d: [] for d in names}
    spent = dict.fromkeys(names, 0.0)
    async with _client(workload) as client:
        first = {d: await proxy_metrics(client, targets[d]) for d in names}
        last = dict(first)
        proxies = {d for d, m in first.items() if m is not None and PROXY_GAUGE in m.names()}
        start = time.perf_counter()
        for i in range(workload.sequential):
            for d in names if i % 2 == 0 else names[::-1]:
                prompt = prompts.make(workload.long_tokens)
                sent = time.perf_counter()
                sample = await one_request(
                    client, targets[d], model, prompt, workload.output_tokens
                )
                spent[d] += time.perf_counter() - sent
                sample.sent_s = sent - start
                if d in proxies:
                    now = await proxy_metrics(client, targets[d])
                    sample.served = served_label(last[d], now)
                    last[d] = now
                samples[d].append(sample)
            _progress(i + 1, workload.sequential, f"{' and '.join(names)}, sequential")
        for d in names:
            if d not in proxies:
                last[d] = await proxy_metrics(client, targets[d])
    return [
        _result(
            d, SEQUENTIAL, 0.0, spent[d], samples[d], first[d], last[d], slo_ttft_ms, slo_itl_ms
        )
        for d in names
    ]


async def run_bench(
    targets: dict[str, str],
    model: str,
    workload: Workload,
    slo_ttft_ms: float,
    slo_itl_ms: float,
    prompts: Prompts | None = None,
) -> list[RateResult]:
    """Every phase of ``workload`` against every target: the sequential one first (when
    asked), then each rate, one target after the other."""
    prompts = prompts or Prompts()
    results = []
    if workload.sequential:
        results += await run_sequential(targets, model, workload, slo_ttft_ms, slo_itl_ms, prompts)
    for rate in workload.rates:
        for deployment, url in targets.items():
            results.append(
                await run_rate(
                    url, model, deployment, rate, workload, slo_ttft_ms, slo_itl_ms, prompts
                )
            )
    return results


def format_table(results: list[RateResult], slo_ttft_ms: float, slo_itl_ms: float) -> str:
    """One line per phase and deployment; a ``connector`` column when the rows came from
    several stacks (``--up --connector``); a sequential phase's rate reads ``seq``."""
    by_connector = any(r.connector for r in results)
    lead = f"{'connector':<19} " if by_connector else ""
    head = (
        f"{lead}{'deployment':<11} {'rate':>5} {'ok':>4} {'fail':>4} {'TTFT p50':>9} "
        f"{'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'SLO met':>8} {'goodput':>8} "
        f"{'stalls':>6}  fallbacks"
    )
    lines = [f"SLO: TTFT <= {slo_ttft_ms:g} ms, mean ITL <= {slo_itl_ms:g} ms", head]
    for r in results:
        total = r.completed + r.failed
        rate = "seq" if r.phase == SEQUENTIAL else f"{r.rate:g}"
        lead = f"{r.connector or '-':<19} " if by_connector else ""
        lines.append(
            f"{lead}{r.deployment:<11} {rate:>5} {r.completed:>4} {r.failed:>4} "
            f"{r.ttft_ms['p50']:>7.1f}ms {r.ttft_ms['p99']:>7.1f}ms {r.itl_ms['p50']:>6.1f}ms "
            f"{r.itl_ms['p99']:>6.1f}ms {r.slo_attained:>4}/{total:<3} {r.goodput_rps:>6.2f}/s "
            f"{r.stalls:>6}  " + _fallbacks_cell(r.fallbacks)
        )
    return "\n".join(lines)


def _fallbacks_cell(fallbacks: dict[str, float] | None) -> str:
    if fallbacks is None:
        return "n/a (metrics unreadable)"
    return ", ".join(f"{k} {v:g}" for k, v in sorted(fallbacks.items())) or "-"


def _series(r: RateResult) -> str:
    return f"{r.deployment} ({r.connector})" if r.connector else r.deployment


def plot(results: list[RateResult], path: Path, title: str) -> None:
    """p99 ITL and goodput against request rate, one line per deployment (and connector);
    sequential phases have no rate and are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    poisson = [r for r in results if r.phase == POISSON]
    for series in dict.fromkeys(_series(r) for r in poisson):
        rows = [r for r in poisson if _series(r) == series]
        rates = [r.rate for r in rows]
        left.plot(rates, [r.itl_ms["p99"] for r in rows], marker="o", label=series)
        right.plot(rates, [r.goodput_rps for r in rows], marker="o", label=series)
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


# -- endpoints and stacks -------------------------------------------------------------------

#: Where ``--up`` stacks write their logs.
LOG_DIR = Path("logs/bench")
#: What ``--up`` says of its numbers.
UP_NOTE = (
    "note: colocated = the stack's decode instance alone; P/D = the proxy over both. On a CPU "
    "host both share the same cores, so this shows the tool works, not the GPU effect of "
    "splitting."
)


def _served_model(url: str) -> str:
    return str(httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"])


@contextmanager
def up_stack(config: UpConfig) -> Iterator[tuple[str, str, str]]:
    """A started stack of ``config`` (engines healthy, the proxy seeing them, one warm-up
    request through it): (colocated URL: its first decode instance, P/D URL: its proxy,
    served model name). Everything it started is stopped on the way out."""
    from vllm_pd_ext.tools.launcher import Stack

    stack = Stack(config)
    stack.build()
    try:
        if not stack.start():
            raise BenchError(
                f"the {config.connector_label} stack did not come up; logs in {config.log_dir}"
            )
        stack.warm_up()
        decode = next(p.url for p in stack.parts if p.name.startswith("decode"))
        yield decode, stack.parts[-1].url, stack.served_name
    finally:
        stack.stop_all()


def stack_configs(
    config_file: Path | None,
    connectors: Sequence[str] | None,
    pdext_backend: str | None,
    cost_model: bool = False,
) -> list[UpConfig]:
    """The stacks ``--up`` brings up: one per name in ``connectors`` (or only the one of
    ``config_file``, else the default 1P1D stack with every prompt split), each from
    ``config_file`` when given (a ``vllm-pd up`` file), with ``pdext_backend`` when given.
    Every stack has the proxy's cost model off (the split path is what is measured) unless
    ``cost_model`` (the proxy decides as a deployment's would) and logs under
    ``logs/bench`` (``logs/bench/<connector>`` with ``connectors``); the proxy's port is
    picked when the stack starts. Raises ValueError on a bad name or file, OSError
    on an unreadable one."""
    from vllm_pd_ext.tools.launcher import UpConfig
    from vllm_pd_ext.util.config_file import read_mapping

    data: dict[str, Any] = (
        read_mapping(config_file) if config_file else {"min_split_prompt_tokens": 0}
    )
    data["cost_model"] = cost_model
    if pdext_backend:
        data["pdext_backend"] = pdext_backend
    if connectors is None:
        return [UpConfig.model_validate({**data, "log_dir": LOG_DIR})]
    names = [c.strip() for c in connectors if c.strip()]
    if not names or len(set(names)) != len(names):
        raise ValueError(f"--connector needs distinct names, got {','.join(connectors)!r}")
    return [
        UpConfig.model_validate({**data, "connector": c, "log_dir": LOG_DIR / c}) for c in names
    ]


def measure_stacks(
    configs: Sequence[UpConfig],
    workload: Workload,
    slo_ttft_ms: float,
    slo_itl_ms: float,
    prompts: Prompts,
    label_rows: bool,
    bring_up: Callable[[UpConfig], AbstractContextManager[tuple[str, str, str]]] = up_stack,
) -> tuple[str, dict[str, dict[str, Any]], list[RateResult]]:
    """Each config's stack in turn, brought up, measured (:func:`run_bench`) and stopped:
    (served model, per connector label its stack's config, targets and the proxy's counters
    at the end (:func:`proxy_counters`), every row). With ``label_rows`` each row names its
    stack's connector. ``bring_up`` starts and stops one stack (:func:`up_stack`)."""
    from vllm_pd_ext.util.vllm_process import free_port

    models: list[str] = []
    stacks: dict[str, dict[str, Any]] = {}
    results: list[RateResult] = []
    for config in configs:
        label = config.connector_label
        print(f"vllm-pd bench: bringing up the {label} stack", file=sys.stderr, flush=True)
        # the proxy's port picked now, once the previous stack has let its ports go
        config = config.model_copy(update={"proxy_port": free_port()})
        with bring_up(config) as (colocated, pd, model):
            models.append(model)
            targets = {"colocated": colocated, "P/D": pd}
            rows = asyncio.run(
                run_bench(targets, model, workload, slo_ttft_ms, slo_itl_ms, prompts)
            )
            stacks[label] = {
                "config": config.model_dump(mode="json"),
                "targets": targets,
                "proxy_counters_at_end": proxy_counters(pd),
            }
        for row in rows:
            row.connector = label if label_rows else None
        results += rows
    return " / ".join(dict.fromkeys(models)), stacks, results


def proxy_counters(url: str) -> dict[str, dict[str, float]] | None:
    """What our proxy at ``url`` has counted since it started: fallbacks by reason,
    decisions by ``decision/reason``, and the pairs whose stall breaker is open now
    (``prefill/decode``); None when its ``/metrics`` cannot be read."""
    try:
        resp = httpx.get(f"{url}/metrics", timeout=10, trust_env=False)
        metrics = parse_metrics(resp.text) if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        metrics = None
    if metrics is None:
        return None
    breakers = metrics.by_label(BREAKER_OPEN, "prefill", "decode")
    return {
        FALLBACKS: metrics.by_label(FALLBACKS, "reason"),
        DECISIONS: metrics.by_label(DECISIONS, "decision", "reason"),
        BREAKER_OPEN: {pair: v for pair, v in breakers.items() if v},
    }


def loadavg() -> list[float] | None:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


@dataclass(frozen=True)
class RunStart:
    """When and where a bench run started."""

    date: str
    loadavg: list[float] | None

    @classmethod
    def now(cls) -> RunStart:
        date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        return cls(date, loadavg())

    def meta(self, model: str, workload: Workload, prompts: Prompts) -> dict[str, Any]:
        """The JSON's head: the model, date, host (with its load at start and now), the
        workload and the prompts' nonce."""
        return {
            "model": model,
            "date": self.date,
            "host": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "python": platform.python_version(),
                "loadavg_at_start": self.loadavg,
                "loadavg_at_end": loadavg(),
            },
            "workload": asdict(workload),
            "prompt_nonce": prompts.nonce,
            "prompts_issued": prompts.issued,
        }


def write_outputs(
    results: list[RateResult],
    meta: dict[str, Any],
    slo_ttft_ms: float,
    slo_itl_ms: float,
    out_json: Path,
    out_png: Path | None,
    note: str = "",
) -> None:
    """Print the table (and ``note``), write the JSON (``meta`` then the SLO, the note and
    every row) and the PNG."""
    print(format_table(results, slo_ttft_ms, slo_itl_ms))
    if note:
        print(note)
    out_json.parent.mkdir(parents=True, exist_ok=True)
    data = {
        **meta,
        "slo": {"ttft_ms": slo_ttft_ms, "itl_ms": slo_itl_ms},
        "stall_factor": STALL_FACTOR,
        "note": note,
        "results": [asdict(r) for r in results],
    }
    out_json.write_text(json.dumps(data, indent=2) + "\n")
    print(f"JSON: {out_json}")
    if out_png is not None:
        plot(results, out_png, f"{meta['model']}: colocated vs P/D")
        print(f"plot: {out_png}")


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
    """``vllm-pd bench --colocated URL --pd URL``: the exit status (1 when a phase got no
    answer at all)."""
    targets = {"colocated": colocated.rstrip("/"), "P/D": pd.rstrip("/")}
    if model is None:
        model = _served_model(targets["P/D"])
    print(
        f"vllm-pd bench: {len(workload.rates)} rates x {workload.requests_per_rate} requests "
        + (f"and {workload.sequential} sequential " if workload.sequential else "")
        + f"x 2 deployments, model {model}",
        file=sys.stderr,
    )
    prompts = Prompts()
    started = RunStart.now()
    results = asyncio.run(run_bench(targets, model, workload, slo_ttft_ms, slo_itl_ms, prompts))
    meta = started.meta(model, workload, prompts) | {"targets": targets}
    write_outputs(results, meta, slo_ttft_ms, slo_itl_ms, out_json, out_png, note)
    return 0 if all(r.completed for r in results) else 1


def bench_up_main(
    configs: Sequence[UpConfig],
    workload: Workload,
    slo_ttft_ms: float,
    slo_itl_ms: float,
    out_json: Path,
    out_png: Path | None,
    label_rows: bool,
    bring_up: Callable[[UpConfig], AbstractContextManager[tuple[str, str, str]]] = up_stack,
) -> int:
    """``vllm-pd bench --up [--connector A,B]``: each config's stack in turn; the exit status
    (1 when a stack did not come up or a phase got no answer at all). ``bring_up`` as in
    :func:`measure_stacks`."""
    prompts = Prompts()
    started = RunStart.now()
    try:
        model, stacks, results = measure_stacks(
            configs, workload, slo_ttft_ms, slo_itl_ms, prompts, label_rows, bring_up
        )
    except BenchError as exc:
        print(f"vllm-pd bench: {exc}", file=sys.stderr)
        return 1
    meta = started.meta(model, workload, prompts) | {"stacks": stacks}
    if not label_rows:  # one stack, as before --connector
        meta["targets"] = next(iter(stacks.values()))["targets"]
    write_outputs(results, meta, slo_ttft_ms, slo_itl_ms, out_json, out_png, UP_NOTE)
    return 0 if all(r.completed for r in results) else 1
