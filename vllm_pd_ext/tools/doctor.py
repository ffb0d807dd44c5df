"""``vllm-pd doctor``: find what makes KV transfer slow on a running P/D pair.

Reads the served model's KV size (``kv-size`` on its ``config.json`` when the model directory
is readable here), the GPU link topology (``nvidia-smi topo -p2p r`` when present), then sends a
few long prompts one at a time, each colocated on the decode instance and split across the pair,
and reports prefill time, the transfer gap (prefill leg done -> first decode token), the
connector's own transfer time and bytes when it exports them (NIXL does), where the decode side's
prompt tokens came from (loaded over KV transfer, its own prefix cache, computed), and plain
advice. Before the prompts, each engine on this host that serves no request has its CPU
measured over a short window (an idle engine should use next to none; vLLM's NixlConnector's
progress thread polls without pause), and the connector counters that say KV was freed unread
or may have been read invalid are compared before and after the run
(:mod:`vllm_pd_ext.tools.engine_checks`).

The colocated and the split measurement of one prompt carry different ``cache_salt`` values
(fresh for each run of the doctor), so neither finds the other's KV in a prefix cache: the
split's decode side has only the transfer to load the prompt from.
"""

from __future__ import annotations

import json
import secrets
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from vllm_pd_ext.tools.engine_checks import (
    BUSY_POLL_PCT,
    IDLE_WINDOW_S,
    CounterMove,
    EngineIdle,
    counter_moves,
    measure_idle,
)
from vllm_pd_ext.tools.kv_size import ConfigError, compute_kv_size, human_bytes, load_config
from vllm_pd_ext.transfer_params import NixlPrefill
from vllm_pd_ext.util.prom import (
    EXTERNAL_KV,
    LOCAL_CACHE_HIT,
    LOCAL_COMPUTE,
    PROMPT_TOKENS_BY_SOURCE,
    parse_metrics,
)

#: Transfer histograms (seconds, bytes) the decode side exports: vLLM's NixlConnector, then
#: our PdExtMoRIIOConnector / PdExtMambaStateConnector.
XFER_METRICS = (
    ("vllm:nixl_xfer_time_seconds", "vllm:nixl_bytes_transferred"),
    ("vllm:pdext_kv_transfer_seconds", "vllm:pdext_kv_transfer_bytes"),
)

#: How long a round waits for the decode side to publish its transfer stats.
STATS_WAIT_S = 10.0
#: The guide's rule of thumb: a mean transfer of this many seconds needs fixing first.
SLOW_TRANSFER_S = 0.3


@dataclass
class Round:
    prompt_tokens: int
    colocated_ttft_ms: float
    prefill_leg_ms: float
    decode_first_token_ms: float
    external_tokens: int
    connector_xfer_ms: float | None
    connector_bytes: float | None
    #: The split's prompt tokens the decode side found in its own prefix cache, and computed
    #: (None: the engine does not count them by source).
    local_cache_hit_tokens: int | None = None
    recomputed_tokens: int | None = None

    @property
    def pd_ttft_ms(self) -> float:
        return self.prefill_leg_ms + self.decode_first_token_ms


@dataclass
class Report:
    model: str
    prefill_url: str
    decode_url: str
    kv_bytes_per_token: int | None
    kv_note: str
    topology: str
    rounds: list[Round] = field(default_factory=list)
    idle: list[EngineIdle] = field(default_factory=list)
    kv_counter_moves: list[CounterMove] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        out = asdict(self)
        for r, raw in zip(out["rounds"], self.rounds, strict=True):
            r["pd_ttft_ms"] = raw.pd_ttft_ms
        return out


def _metrics(client: httpx.Client, url: str):
    return parse_metrics(client.get(f"{url}/metrics").text)


def _model_info(client: httpx.Client, url: str) -> tuple[str, str | None, int | None]:
    data = client.get(f"{url}/v1/models").json()["data"][0]
    return data["id"], data.get("root"), data.get("max_model_len")


def _kv_per_token(root: str | None) -> tuple[int | None, str]:
    if not root or not Path(root).is_dir():
        return None, "model directory not readable here: KV size unknown (run kv-size on it)"
    try:
        size = compute_kv_size(load_config(root))
    except ConfigError as exc:
        return None, f"cannot size the KV cache: {exc}"
    return size.bytes_per_token, (
        f"{size.bytes_per_token:,} B per token ({human_bytes(size.bytes_per_token)}), {size.dtype}"
    )


def gpu_topology() -> str:
    """``nvidia-smi topo -p2p r`` output, or why there is none."""
    if shutil.which("nvidia-smi") is None:
        return "nvidia-smi not found: no NVIDIA GPU on this host (or no driver tools)"
    try:
        proc = subprocess.run(
            ["nvidia-smi", "topo", "-p2p", "r"], capture_output=True, text=True, timeout=15
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-smi topo failed: {exc}"
    return proc.stdout.strip() or proc.stderr.strip()


def _prompt(tokens: int, round_index: int) -> list[int]:
    # Distinct, deterministic token ids in a small-id range every vocabulary has.
    return [100 + (i * 7 + round_index * 13) % 900 for i in range(tokens)]


def _stream_first_token(client: httpx.Client, url: str, body: dict) -> float:
    start = time.perf_counter()
    with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"{url} answered {r.status_code}: {r.text[:500]}")
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - start
    raise RuntimeError(f"{url} streamed no tokens")


def _await_transfer_stats(client: httpx.Client, decode: str, before, timeout: float = STATS_WAIT_S):
    """The decode side's metrics once this round's load shows in them.

    vLLM publishes connector stats with a later engine step's output, so the scrape right
    after the first token can miss them. Polls until the external-token counter moved and a
    transfer histogram counted the load (or the engine exports none); after ``timeout`` it
    returns the last scrape, in which a missing transfer then reads as "not reported".
    """
    deadline = time.monotonic() + timeout
    while True:
        after = _metrics(client, decode)
        loaded = after.total(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV) > before.total(
            PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV
        )
        counts = [f"{t}_count" for t, _ in XFER_METRICS if f"{t}_count" in after.names()]
        counted = not counts or any(after.total(c) > before.total(c) for c in counts)
        if (loaded and counted) or time.monotonic() >= deadline:
            return after
        time.sleep(0.1)


def measure_round(
    client: httpx.Client,
    prefill: str,
    decode: str,
    model: str,
    tokens: int,
    index: int,
    salt: str = "",
) -> Round:
    """One prompt, colocated then split; ``salt`` (a run's own) keeps the two measurements
    and earlier runs out of each other's prefix caches."""
    prompt = _prompt(tokens, index)
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    colocated = _stream_first_token(
        client, decode, {**body, "cache_salt": f"{salt}-colocated-{index}"}
    )
    body["cache_salt"] = f"{salt}-split-{index}"
    before = _metrics(client, decode)
    start = time.perf_counter()
    resp = client.post(
        f"{prefill}/v1/completions", json={**body, "kv_transfer_params": NixlPrefill().params()}
    )
    prefill_s = time.perf_counter() - start
    resp.raise_for_status()
    params = resp.json().get("kv_transfer_params")
    if not params:
        raise RuntimeError(f"{prefill} returned no kv_transfer_params: is a P/D connector set?")
    first = _stream_first_token(client, decode, {**body, "kv_transfer_params": params})
    after = _await_transfer_stats(client, decode, before)

    def delta(name: str, **labels: str) -> float:
        return after.total(name, **labels) - before.total(name, **labels)

    xfer_time, xfer_bytes = next(
        ((t, b) for t, b in XFER_METRICS if delta(f"{t}_count")), XFER_METRICS[0]
    )
    xfer_count = delta(f"{xfer_time}_count")
    by_source = PROMPT_TOKENS_BY_SOURCE in after.names()
    return Round(
        prompt_tokens=tokens,
        colocated_ttft_ms=colocated * 1e3,
        prefill_leg_ms=prefill_s * 1e3,
        decode_first_token_ms=first * 1e3,
        external_tokens=int(delta(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV)),
        connector_xfer_ms=delta(f"{xfer_time}_sum") * 1e3 if xfer_count else None,
        connector_bytes=delta(f"{xfer_bytes}_sum") if xfer_count else None,
        local_cache_hit_tokens=(
            int(delta(PROMPT_TOKENS_BY_SOURCE, **LOCAL_CACHE_HIT)) if by_source else None
        ),
        recomputed_tokens=int(delta(PROMPT_TOKENS_BY_SOURCE, **LOCAL_COMPUTE))
        if by_source
        else None,
    )


def advise(report: Report, link_gbps: float | None, busy_pct: float = BUSY_POLL_PCT) -> list[str]:
    advice = [str(m) for m in report.kv_counter_moves]
    advice += [w for w in (e.warning(busy_pct) for e in report.idle) if w]
    rounds = report.rounds
    if not rounds:
        return [*advice, "no measurements"]
    gap = statistics.mean(r.decode_first_token_ms for r in rounds)
    colocated = statistics.mean(r.colocated_ttft_ms for r in rounds)
    pd = statistics.mean(r.pd_ttft_ms for r in rounds)
    # the decode side computes the prompt's last token itself; more than that is a recompute
    missing = [
        r
        for r in rounds
        if (r.recomputed_tokens > 1 if r.recomputed_tokens is not None else False)
        or r.external_tokens + (r.local_cache_hit_tokens or 0) < r.prompt_tokens - 1
    ]
    if missing:
        advice.append(
            f"{len(missing)} of {len(rounds)} prompts were NOT loaded over KV transfer (the "
            "decode side recomputed them): check the connector configuration and logs"
        )
    xfers = [
        (r.connector_xfer_ms, r.connector_bytes)
        for r in rounds
        if r.connector_xfer_ms and r.connector_bytes is not None
    ]
    if xfers:
        xfer_ms = statistics.mean(ms for ms, _ in xfers)
        mbytes = statistics.mean(nbytes for _, nbytes in xfers) / 1e6
        gbps = mbytes * 8 / xfer_ms if xfer_ms else 0.0  # MB/ms*8 = Gb/s
        line = f"mean transfer {xfer_ms:.1f} ms for {mbytes:.2f} MB ({gbps:.2f} Gb/s effective)"
        if link_gbps:
            line += f", {100 * gbps / link_gbps:.0f}% of the {link_gbps:g} Gb/s link"
            if gbps < 0.5 * link_gbps:
                line += (
                    ": well below the link; look for host staging (no GPU P2P/RDMA), "
                    "small spans, or a TCP fallback"
                )
        advice.append(line)
        if xfer_ms / 1e3 >= SLOW_TRANSFER_S:
            advice.append(
                "a mean transfer of several hundred ms or more: fix the transfer "
                "before tuning anything else"
            )
    else:
        advice.append(
            "the connector exports no transfer-time metrics; the transfer gap below "
            "is measured end to end"
        )
    verdict = (
        f"P/D TTFT {pd:.1f} ms vs colocated {colocated:.1f} ms (transfer gap + first "
        f"decode token {gap:.1f} ms)"
    )
    if pd > colocated:
        verdict += (
            ": at this prompt length and load, colocated serving beats P/D on TTFT; "
            "split only when long prefills stall running decodes (p99 ITL)"
        )
    else:
        verdict += ": splitting costs no TTFT here"
    advice.append(verdict)
    return advice


def run_doctor(
    prefill: str,
    decode: str,
    prompts: int,
    prompt_tokens: int | None,
    link_gbps: float | None,
    idle_window_s: float = IDLE_WINDOW_S,
    busy_pct: float = BUSY_POLL_PCT,
) -> Report:
    """Probe a P/D pair and return the report (raises on unreachable instances).
    ``idle_window_s`` 0 leaves the idle-CPU measurement out."""
    prefill, decode = prefill.rstrip("/"), decode.rstrip("/")
    engines = {"prefill": prefill, "decode": decode}
    with httpx.Client(timeout=httpx.Timeout(300.0, connect=5.0), trust_env=False) as client:
        for url in (prefill, decode):
            client.get(f"{url}/health").raise_for_status()
        counters_before = {role: _metrics(client, url) for role, url in engines.items()}
        idle = (
            measure_idle(engines, lambda url: _metrics(client, url), idle_window_s)
            if idle_window_s > 0
            else []
        )
        model, root, max_len = _model_info(client, decode)
        per_token, note = _kv_per_token(root)
        tokens = prompt_tokens or max(16, min(4096, (max_len or 512) - 16))
        report = Report(
            model=model,
            prefill_url=prefill,
            decode_url=decode,
            kv_bytes_per_token=per_token,
            kv_note=note,
            topology=gpu_topology(),
            idle=idle,
        )
        salt = f"vllm-pd-doctor-{secrets.token_hex(8)}"
        measure_round(client, prefill, decode, model, min(tokens, 64), 999, salt)  # warm-up
        for i in range(prompts):
            report.rounds.append(measure_round(client, prefill, decode, model, tokens, i, salt))
        for role, url in engines.items():
            after = _metrics(client, url)
            report.kv_counter_moves += counter_moves(role, url, counters_before[role], after)
    report.advice = advise(report, link_gbps, busy_pct)
    return report


def format_report(report: Report) -> str:
    lines = [
        f"model: {report.model}",
        f"prefill: {report.prefill_url}   decode: {report.decode_url}",
        f"KV cache: {report.kv_note}",
        f"GPU topology: {report.topology}",
        "",
        f"{'prompt':>7} {'colocated':>10} {'prefill':>9} {'gap+1st':>9} {'P/D TTFT':>9} "
        f"{'KV tokens':>9} {'cached':>7} {'computed':>8} {'xfer ms':>8} {'MB':>8}",
    ]
    for r in report.rounds:
        xfer = f"{r.connector_xfer_ms:8.1f}" if r.connector_xfer_ms is not None else f"{'-':>8}"
        mb = f"{r.connector_bytes / 1e6:8.2f}" if r.connector_bytes is not None else f"{'-':>8}"
        lines.append(
            f"{r.prompt_tokens:>7} {r.colocated_ttft_ms:>8.1f}ms {r.prefill_leg_ms:>7.1f}ms "
            f"{r.decode_first_token_ms:>7.1f}ms {r.pd_ttft_ms:>7.1f}ms {r.external_tokens:>9} "
            f"{_count(r.local_cache_hit_tokens):>7} {_count(r.recomputed_tokens):>8} {xfer} {mb}"
        )
    if report.idle:
        lines += ["", "idle CPU (each engine's processes, while it serves nothing):"]
        lines += [f"  {e.line()}" for e in report.idle]
    lines += ["", "advice:"] + [f"  - {a}" for a in report.advice]
    return "\n".join(lines)


def _count(n: int | None) -> str:
    return "-" if n is None else str(n)


def doctor_main(
    prefill: str,
    decode: str,
    prompts: int,
    prompt_tokens: int | None,
    link_gbps: float | None,
    as_json: bool,
    idle_window_s: float = IDLE_WINDOW_S,
    busy_pct: float = BUSY_POLL_PCT,
) -> int:
    try:
        report = run_doctor(
            prefill, decode, prompts, prompt_tokens, link_gbps, idle_window_s, busy_pct
        )
    except (httpx.HTTPError, RuntimeError, KeyError, ValueError) as exc:
        print(f"vllm-pd doctor: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report.to_json()) if as_json else format_report(report))
    return 0
