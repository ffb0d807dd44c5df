"""Idle CPU of every part of a P/D stack: our connector vs vLLM's NixlConnector.

Each round brings up the ``vllm-pd up`` stack of ``--config`` (default
``examples/up-token.yaml``: tiny-llama in token mode, so a render server, one prefill and one
decode ``vllm serve`` on CPU, and the proxy) through the launcher's own
:class:`~vllm_pd_ext.tools.launcher.Stack`, once with our connector (``PdExtMoRIIOConnector``
over its ``tcp`` backend) and once with ``NixlConnector``, the order swapped every round. Both
run as ``vllm-pd up`` leaves them: NIXL's idle progress thread at the lowest CPU priority. For
each stack:

* wait until every part is healthy, then the launcher's warm-up (one request long enough to
  split);
* ``before``: each part's CPU (its process tree: render server, API server with its EngineCore
  and worker, proxy) over ``--idle-s`` seconds, nothing in flight;
* ``--requests`` sequential streamed completions (``max_tokens`` 16) of ``--prompt-tokens``
  unique token ids each, split by the proxy (its cost model off);
* once the engines report no request running or waiting: each part's CPU over the first 2 s
  (``settling``: the prefill still releases the last request's KV), then, ``--settle-s`` after
  that point, over ``--idle-s`` seconds: ``after``;
* in both idle windows, the threads of a part at 20% of a core or more; at the end, each
  engine's held KV blocks and lease-expiry / failure counters (ours and NIXL's);
* stop the stack and check that no process of it, and no ``vllm serve`` at all, is left.

Summary per connector and part over all rounds: median and max of the ``before`` and
``after`` windows, in % of one core.

Another job's engines on the same cores would skew both, so the run refuses to start while
any ``vllm serve`` is running; run it under the lock the integration tests take:

    flock /tmp/vllm-serve.lock env PYTHONPATH=$PWD .venv/bin/python benchmarks/idle_cpu.py
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from pd_backends import (
    RunError,
    config_name,
    prompts,
    run_head,
    run_main,
    scrape,
    stopped_cleanly,
    stream,
    thread_line,
    vllm_serve_processes,
    vocab_size,
    wait_idle,
)

from vllm_pd_ext.tools.engine_checks import BLOCKS_HELD, KV_COUNTERS
from vllm_pd_ext.tools.launcher import Part, Stack, UpConfig
from vllm_pd_ext.util.config_file import read_mapping
from vllm_pd_ext.util.proc_cpu import TreeCpu, trees_cpu
from vllm_pd_ext.util.vllm_process import free_port

REPO = Path(__file__).resolve().parent.parent
#: connector name in ``vllm-pd up`` -> its overrides of the config
PEERS: dict[str, dict[str, Any]] = {
    "pdext": {"connector": "pdext", "pdext_backend": "tcp"},
    "nixl": {"connector": "nixl"},
}
#: A part this busy (share of a core) in an idle window gets its busiest threads recorded.
BUSY_SHARE = 0.2
WINDOWS = ("before", "settling", "after")


def window(parts: list[Part], seconds: float) -> tuple[dict[str, float], dict[str, list[str]]]:
    """Each part's CPU over the next ``seconds`` (% of one core), and the threads of the parts
    at ``BUSY_SHARE`` of a core or more."""
    used: dict[str, TreeCpu] = trees_cpu({p.name: p.proc.pid for p in parts}, seconds)
    busy = {
        name: [thread_line(t) for t in u.threads if t.share >= BUSY_SHARE]
        for name, u in used.items()
        if u.share >= BUSY_SHARE
    }
    return {name: u.pct for name, u in used.items()}, busy


def run_stack(
    args: argparse.Namespace, peer: str, round_index: int, batch: list[list[int]]
) -> dict[str, Any]:
    """One connector's stack in one round: its measurements."""
    data = read_mapping(args.config)
    data.update(
        PEERS[peer],
        proxy_port=free_port(),
        cost_model=False,
        log_dir=str(args.log_dir / f"r{round_index}-{peer}"),
    )
    config = UpConfig.model_validate(data)
    stack = Stack(config)
    stack.build()
    record: dict[str, Any] = {"round": round_index, "connector": peer}
    try:
        if not stack.start():
            raise RunError(f"{peer}: the stack did not come up; logs in {config.log_dir}")
        stack.warm_up()
        parts = [p for p in stack.parts if p.handle is not None]
        engines = [p for p in parts if p.name.startswith(("prefill", "decode"))]
        proxy = next(p for p in parts if p.name == "proxy")
        with httpx.Client(timeout=httpx.Timeout(180.0, connect=5.0)) as client:
            wait_idle(client, engines)
            record["cpu_pct_of_a_core"] = cpu = {}
            record["busy_threads"] = busy = {}
            cpu["before"], busy["before"] = window(parts, args.idle_s)
            ttft = []
            for prompt in batch:
                body = {
                    "model": stack.served_name,
                    "prompt": prompt,
                    "max_tokens": args.max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "return_token_ids": True,
                }
                _, first = stream(client, proxy.url, body)
                ttft.append(round(first * 1e3, 2))
            split = scrape(client, proxy.url).by_label("vllm_pd_decisions_total", "decision")
            wait_idle(client, engines)
            cpu["settling"], busy["settling"] = window(parts, 2.0)
            time.sleep(max(0.0, args.settle_s - 2.0))  # the rest of the settling time
            cpu["after"], busy["after"] = window(parts, args.idle_s)
            record["engines_at_end"] = {p.name: _kv_state(scrape(client, p.url)) for p in engines}
        record.update(ttft_ms=ttft, decisions=split)
    finally:
        groups = [p.proc.pid for p in stack.parts if p.handle is not None]
        stack.stop_all()
        left = stopped_cleanly(groups)
    record["left_after_stop"] = left
    if left:
        raise RunError(f"{peer}: processes left after the stack stopped: {left}")
    return record


def _kv_state(metrics: Any) -> dict[str, float]:
    """An engine's held KV blocks and every KV counter it exports."""
    state = {c.label: c.value(metrics) for c in KV_COUNTERS if c.sample in metrics.names()}
    if BLOCKS_HELD in metrics.names():
        state[BLOCKS_HELD] = metrics.total(BLOCKS_HELD)
    return state


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for peer in PEERS:
        mine = [r for r in rounds if r["connector"] == peer]
        parts = list(mine[0]["cpu_pct_of_a_core"]["after"])
        out[peer] = {
            w: {
                name: {
                    "median": round(
                        float(np.median([r["cpu_pct_of_a_core"][w][name] for r in mine])), 1
                    ),
                    "max": max(r["cpu_pct_of_a_core"][w][name] for r in mine),
                }
                for name in parts
            }
            for w in WINDOWS
        }
        out[peer]["requests_split"] = sum(r["decisions"].get("split", 0) for r in mine)
    return out


def print_table(result: dict[str, Any]) -> None:
    m = result["machine"]
    print(
        f"\nidle CPU, % of one core (median of {result['rounds']} rounds, max); "
        f"{m['cpus']} CPUs, load {m['loadavg_at_start'][0]:.2f} -> {m['loadavg_at_end'][0]:.2f}"
    )
    for peer in PEERS:
        s = result["summary"][peer]
        for w in WINDOWS:
            cells = ", ".join(f"{k} {v['median']} (max {v['max']})" for k, v in s[w].items())
            print(f"{peer:<6} {w:<9} {cells}")
    for r in result["every_round"]:
        for w, parts in r["busy_threads"].items():
            for name, threads in parts.items():
                print(f"busy: round {r['round'] + 1} {r['connector']} {w} {name}: {threads}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=REPO / "examples" / "up-token.yaml")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; each runs every connector")
    ap.add_argument("--requests", type=int, default=10, help="split requests per stack")
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument(
        "--settle-s",
        type=float,
        default=4.0,
        help="from the engines' last request to the 'after' window (the first 2 s are "
        "recorded apart)",
    )
    ap.add_argument("--idle-s", type=float, default=5.0, help="each idle window")
    ap.add_argument("--log-dir", type=Path, default=Path("logs/idle_cpu"))
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "idle_cpu.json")
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
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stacks stop in their finally
    strays = vllm_serve_processes()
    if strays:
        print("vllm serve is already running; measure on a quiet host:", *strays, sep="\n  ")
        return 1
    config = UpConfig.model_validate(read_mapping(args.config))
    vocab = vocab_size(config.model)
    load_start = os.getloadavg()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        batch = prompts(r, args.requests, args.prompt_tokens, vocab)
        order = list(PEERS) if r % 2 == 0 else list(PEERS)[::-1]
        for peer in order:
            print(f"round {r + 1}/{args.rounds}: {peer}", file=sys.stderr, flush=True)
            rounds.append(run_stack(args, peer, r, batch))
    result = {
        **run_head("idle_cpu", started, load_start),
        "config": config_name(args.config),
        "mode": config.mode,
        "peers": PEERS,
        "calm_idle_pollers": config.calm_idle_pollers,
        "rounds": args.rounds,
        "requests_per_stack": args.requests,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "settle_s": args.settle_s,
        "idle_s": args.idle_s,
        "summary": summarize(rounds),
        "every_round": rounds,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    run_main("idle_cpu", main)
