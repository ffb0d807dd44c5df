"""Restore bandwidth of PdExtFlexKVConnector's CPU and SSD tiers next to the host's floors.

In one process: a worker-side ``FlexKVWorker`` over CPU "KV cache" tensors shaped like vLLM's
CPU backend saves N blocks (CPU rows + SSD files), then loads them back into other blocks from
the CPU tier and from the SSD tier (checksums verified). Floors, measured on the same bytes:
``memcpy`` (torch copy between two already-touched buffers of the same size) and a sequential
read of one file of the same size (page cache warm, as the block files are: both are reads
of recently written data).
Saves: the time ``wait_for_save`` takes in the engine step, until the save thread releases the
blocks (``finished_sending``), until the files are written, and, for reference, the same gather
and CPU-row copy run synchronously (what ``wait_for_save`` used to do in the step).
Prints a table and writes ``benchmarks/results/flexkv_restore.json``. Median of ``--rounds``.

    .venv/bin/python benchmarks/flexkv_restore.py --blocks 256 --rounds 5
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

import torch

from vllm_pd_ext.connectors.flexkv.config import FlexKVConfig
from vllm_pd_ext.connectors.flexkv.keys import chain_keys, root_hash
from vllm_pd_ext.connectors.flexkv.metadata import (
    CPU,
    SSD,
    FlexKVMetadata,
    LoadItem,
    LoadJob,
    SaveItem,
)
from vllm_pd_ext.connectors.flexkv.worker import FlexKVWorker

LAYERS, HEADS, HEAD, BLOCK = 8, 8, 128, 32  # 256 KiB per block in bf16 across 8 layers


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--io-threads", type=int, default=4)
    args = ap.parse_args()
    n = args.blocks
    caches = {
        f"layer{i}": torch.randn(2 * n, HEADS, BLOCK, 2 * HEAD).to(torch.bfloat16)
        for i in range(LAYERS)
    }
    with tempfile.TemporaryDirectory() as tmp:
        cfg = FlexKVConfig(cpu_capacity_blocks=n, ssd_dir=tmp, io_threads=args.io_threads)
        w = FlexKVWorker(
            cfg, namespace="bench", num_blocks=2 * n, block_size=BLOCK, model={}, cpu_slots=n
        )
        w.register_kv_caches(caches)
        keys = chain_keys(root_hash("bench", None, None), list(range(n * BLOCK)), BLOCK, n)
        # Saves, median of the rounds; each round also runs the old synchronous save path (the
        # gather + CPU-row copy in the step) on the same blocks for reference. One untimed save
        # first, so neither pays the CPU pool's first touch.
        cpu_only = [SaveItem(b, keys[b], "sync", slot=b) for b in range(n)]
        w._run_save(cpu_only)
        saving: dict[str, list[float]] = {"step": [], "held": [], "files": [], "sync": []}
        for r in range(args.rounds):
            t0 = time.perf_counter()
            w._run_save(cpu_only)
            saving["sync"].append(time.perf_counter() - t0)
            rid = f"save{r}"
            w.bind(
                FlexKVMetadata(
                    saves=[SaveItem(b, keys[b], rid, slot=b, ssd=True) for b in range(n)]
                )
            )
            t0 = time.perf_counter()
            w.wait_for_save()
            saving["step"].append(time.perf_counter() - t0)
            while rid not in w.get_finished({rid})[0]:
                time.sleep(0.001)
            saving["held"].append(time.perf_counter() - t0)
            w.wait_idle(300)
            saving["files"].append(time.perf_counter() - t0)
        save_ms = {k: round(statistics.median(v) * 1e3, 1) for k, v in saving.items()}
        nbytes = n * w.block_bytes
        results: dict[str, list[float]] = {
            "cpu_tier": [],
            "ssd_tier": [],
            "memcpy": [],
            "seq_read": [],
        }
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst_mem = torch.zeros(nbytes, dtype=torch.uint8)  # touched: the floor pays no page faults
        big = Path(tmp) / "floor.bin"
        big.write_bytes(os.urandom(nbytes))
        dst = bytearray(nbytes)
        for r in range(args.rounds):
            for tier, name in ((CPU, "cpu_tier"), (SSD, "ssd_tier")):
                items = tuple(
                    LoadItem(n + b, keys[b], tier, slot=b if tier == CPU else -1) for b in range(n)
                )
                w.bind(FlexKVMetadata(loads=[LoadJob(f"{name}{r}", items)]))
                t0 = time.perf_counter()
                w.start_load_kv()
                w.wait_idle(300)
                results[name].append(time.perf_counter() - t0)
                assert not w.take_load_errors() and w.get_finished()[1] == {f"{name}{r}"}
            for layer in caches.values():
                assert torch.equal(layer[n:], layer[:n])
            t0 = time.perf_counter()
            dst_mem.copy_(src)
            results["memcpy"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            with open(big, "rb", buffering=0) as f:
                f.readinto(dst)
            results["seq_read"].append(time.perf_counter() - t0)
        w.shutdown()
    gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in results.items()}
    out = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "blocks": n,
        "block_bytes": w.block_bytes,
        "MB": round(nbytes / 1e6, 1),
        "GB_per_s": {k: round(v, 2) for k, v in gbps.items()},
        "cpu_tier_vs_memcpy": round(gbps["cpu_tier"] / gbps["memcpy"], 2),
        "ssd_tier_vs_seq_read": round(gbps["ssd_tier"] / gbps["seq_read"], 2),
        "save_step_ms": save_ms["step"],
        "save_blocks_held_ms": save_ms["held"],
        "save_with_files_ms": save_ms["files"],
        "save_sync_copy_ms": save_ms["sync"],
        "save_step_vs_sync": round(save_ms["step"] / save_ms["sync"], 4),
        "rounds": args.rounds,
    }
    print(f"{n} blocks x {w.block_bytes // 1024} KiB = {out['MB']} MB, median of {args.rounds}")
    print(f"{'path':<12}{'GB/s':>8}")
    for k, v in out["GB_per_s"].items():
        print(f"{k:<12}{v:>8}")
    print(
        f"CPU tier / memcpy: {out['cpu_tier_vs_memcpy']}  SSD tier / sequential read: "
        f"{out['ssd_tier_vs_seq_read']}  (goal >= 0.5 each)"
    )
    print(
        f"save: {out['save_step_ms']} ms in the step (wait_for_save), blocks held "
        f"{out['save_blocks_held_ms']} ms, files written after {out['save_with_files_ms']} ms; "
        f"a synchronous gather + CPU-row copy of the same blocks: {out['save_sync_copy_ms']} ms"
    )
    dest = Path(__file__).parent / "results" / "flexkv_restore.json"
    dest.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
