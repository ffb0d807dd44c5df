"""One request's READ between tensor parallel sizes: prefill TP 2 -> decode TP 1 next to
prefill TP 1 -> decode TP 1, on the same cache layout, through our connector's worker side.

The KV of one ``--tokens`` prompt (default 8192) of a Qwen2.5-7B-shaped model (28 layers,
4 KV heads, head dim 128, bf16, 16-token blocks: 56 KiB a token, 448 MiB for 8k tokens;
``--layers``, ``--kv-heads``, ``--head-dim`` for another model), in vLLM's CPU cache layout
(per layer ``[blocks, kv_heads, block_size, 2 * head_dim]``, head-major). Two prefill engines
hold the same model KV (:func:`vllm_pd_ext.testing.kv_ranks.model_kv`, one seed):

* ``tp2``: two ranks, each in its own process with its 2 heads; the decode rank reads its 4
  heads from both (a 16 KiB head slice of each block of each layer from each rank, both
  ranks at once);
* ``tp1``: one rank in its own process with all 4 heads; the decode rank reads whole blocks
  (32 KiB each).

The decode rank (TP 1, in this process) is a real ``TransferWorker`` of
``PdExtMoRIIOConnector``'s worker side, driven as vLLM's runner drives it: each prefill rank
binds the finished request (``SendSpec``, READ: its blocks held under a lease), the decode
worker binds a ``RecvSpec`` with the READ answer's ``RemoteRef`` (``tp_size`` 1 or 2),
``start_load_kv``, then ``get_finished`` until the load is reported; the prefill ranks then
wait for the "done" that frees the request. Prefill blocks and decode blocks are two random
permutations of 1..n (block 0 is vLLM's null block), as in engines that have run for a while.

Per round, for each engine (the order swapped every round): the decode caches are zeroed,
the request is loaded and timed, every decode block is compared byte for byte with the
model's heads it must hold, and the memcpy floor (``torch`` copies of the same bytes, one
per layer, in this process) is timed beside it. A warm-up load per engine first (its
handshakes and connections: reported as ``first_load_ms``, not in the medians). Figures:
``load_ms``, the worker's own time for the load as its connector stats record it (the
``/renew`` of every source rank, the reads, the "done" notices), and ``wall_ms``, from
``start_load_kv`` until ``get_finished`` reported it (polled every millisecond); GB/s is
the KV bytes over ``load_ms``; ``tp2/tp1`` is the median of per-round ratios of ``load_ms``.

One phase per backend (``--backends``, default ``tcp`` then ``cma``), each with its own
engines, so no backend's threads compete with another's. Writes
``benchmarks/results/tp_transfer.json``. Run (about 2 minutes on 2 cores), holding the
integration tests' lock too so that no ``vllm serve`` shares the cores:

    flock /tmp/vllm-serve.lock flock /tmp/bench.lock \
        env PYTHONPATH=$PWD .venv/bin/python benchmarks/tp_transfer.py
    ... benchmarks/tp_transfer.py --layers 16 --kv-heads 8 --out .../tp_transfer_8heads.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from pd_backends import REPO, RunError, run_head, run_main
from transport_bandwidth import memcpy_seconds

from vllm_pd_ext.testing.kv_ranks import (
    KVShape,
    PrefillEngine,
    check_landed,
    model_kv,
    rank_caches,
    rank_worker,
    read_request,
)
from vllm_pd_ext.util.vllm_process import free_port

#: The engines compared: name -> prefill TP size (the decode rank is TP 1 in both).
ENGINES = {"tp2": 2, "tp1": 1}
SEED = 7


def permutation(n: int, seed: str) -> list[int]:
    """Blocks 1..n in an order fixed by ``seed``."""
    ids = list(range(1, n + 1))
    random.Random(seed).shuffle(ids)
    return ids


def run_backend(args: argparse.Namespace, shape: KVShape, backend: str) -> dict[str, Any]:
    """One phase: both prefill engines and the decode rank over ``backend``, ``--rounds``
    interleaved rounds."""
    import torch

    n = -(-args.tokens // shape.block_size)
    num_blocks = n + 1
    pairs = tuple(
        zip(permutation(n, "decode"), permutation(n, "prefill"), strict=True)
    )  # (decode block, prefill block)
    remote = tuple(r for _, r in pairs)
    model = {shape.layer_name(i): model_kv(shape, num_blocks, SEED, i) for i in range(shape.layers)}
    engines: dict[str, PrefillEngine] = {}
    d = rank_worker("kv_consumer", "decode", free_port(), backend, shape, num_blocks)
    try:
        for name, tp in ENGINES.items():
            engines[name] = PrefillEngine(
                f"prefill-{name}", free_port(), backend, shape, num_blocks, SEED, tp
            )
        caches = rank_caches(shape, num_blocks, 1, 0, None)
        d.register_kv_caches(caches)
        seq = 0

        def once(name: str) -> dict[str, Any]:
            nonlocal seq
            seq += 1
            req = f"req-{name}-{seq}"
            for t in caches.values():
                t.zero_()
            engine = engines[name]
            engine.hold(req, remote)
            load = read_request(d, engine.ref(req), pairs, req)
            engine.wait_released(req)
            checked = check_landed(shape, caches, model, pairs)
            if load.nbytes != checked:
                raise RunError(f"{name}: the worker moved {load.nbytes} bytes, {checked} expected")
            return {
                "load_ms": 1e3 * load.load_s,
                "wall_ms": 1e3 * load.wall_s,
                "bytes": load.nbytes,
                "GBps": load.nbytes / load.load_s / 1e9,
                "checked_bytes": checked,
            }

        first = {name: once(name)["load_ms"] for name in ENGINES}
        rounds = []
        for r in range(args.rounds):
            row: dict[str, Any] = {}
            order = list(ENGINES) if r % 2 == 0 else list(ENGINES)[::-1]
            for name in order:
                row[name] = once(name)
            memcpy = sum(
                memcpy_seconds(
                    model[layer].view(torch.uint8).numpy(), caches[layer].view(torch.uint8).numpy()
                )
                for layer in caches
            )
            row["memcpy_ms"] = 1e3 * memcpy
            row["order"] = order
            rounds.append(row)
            print(
                f"{backend} round {r + 1}/{args.rounds}: "
                + ", ".join(f"{k} {row[k]['load_ms']:.1f} ms" for k in ENGINES)
                + f", memcpy {row['memcpy_ms']:.1f} ms",
                file=sys.stderr,
                flush=True,
            )
    finally:
        d.shutdown()
        for engine in engines.values():
            engine.stop()
    return {"first_load_ms": first, "rounds": rounds}


def summarize(phase: dict[str, Any]) -> dict[str, Any]:
    rounds = phase["rounds"]
    out: dict[str, Any] = {}
    for name in ENGINES:
        rows = [r[name] for r in rounds]
        out[name] = {
            "load_ms_median": round(statistics.median(x["load_ms"] for x in rows), 2),
            "wall_ms_median": round(statistics.median(x["wall_ms"] for x in rows), 2),
            "GBps_median": round(statistics.median(x["GBps"] for x in rows), 3),
            "bytes": rows[0]["bytes"],
            "first_load_ms": round(phase["first_load_ms"][name], 2),
        }
    memcpy_ms = statistics.median(r["memcpy_ms"] for r in rounds)
    out["memcpy_ms_median"] = round(memcpy_ms, 2)
    out["memcpy_GBps_median"] = round(out["tp1"]["bytes"] / memcpy_ms / 1e6, 3)
    out["tp2_over_tp1"] = round(
        statistics.median(r["tp2"]["load_ms"] / r["tp1"]["load_ms"] for r in rounds), 3
    )
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--backends", default="tcp,cma", help="comma-separated, one phase each")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/tp_transfer.json")
    args = ap.parse_args(argv)
    if args.rounds < 2:
        ap.error("--rounds must be at least 2 (the order is swapped every round)")
    if args.kv_heads % 2:
        ap.error("--kv-heads must split over two prefill ranks")
    args.backends = args.backends.split(",")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shape = KVShape(args.layers, args.kv_heads, args.head_dim, dtype=args.dtype)
    load_start = os.getloadavg()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    t0 = time.monotonic()
    phases = {backend: run_backend(args, shape, backend) for backend in args.backends}
    result = {
        **run_head("tp_transfer", started, load_start),
        "shape": {**vars(shape), "bytes_per_token": shape.token_bytes},
        "tokens": args.tokens,
        "rounds": args.rounds,
        "engines": {
            "tp2": "prefill TP 2 (two processes, half the KV heads each) -> decode TP 1",
            "tp1": "prefill TP 1 (one process, every KV head) -> decode TP 1",
        },
        "summary": {backend: summarize(phase) for backend, phase in phases.items()},
        "every_round": phases,
        "elapsed_s": round(time.monotonic() - t0, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    m = result["machine"]
    print(f"load {m['loadavg_at_start']} -> {m['loadavg_at_end']}")
    mib = result["summary"][args.backends[0]]["tp1"]["bytes"] / 2**20
    print(f"{args.tokens} tokens, {mib:.0f} MiB of KV a request, {args.rounds} rounds")
    print(f"{'backend':<8} {'engine':<6} {'load ms':>9} {'wall ms':>9} {'GB/s':>7} {'first ms':>9}")
    for backend, s in result["summary"].items():
        for name in ENGINES:
            e = s[name]
            print(
                f"{backend:<8} {name:<6} {e['load_ms_median']:>9.1f} {e['wall_ms_median']:>9.1f} "
                f"{e['GBps_median']:>7.2f} {e['first_load_ms']:>9.1f}"
            )
        print(
            f"{backend:<8} tp2/tp1 {s['tp2_over_tp1']:.3f}; memcpy floor "
            f"{s['memcpy_ms_median']:.1f} ms ({s['memcpy_GBps_median']:.2f} GB/s)"
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    run_main("tp_transfer", main)
