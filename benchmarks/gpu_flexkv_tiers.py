"""GPU check of PdExtFlexKVConnector's CPU tier: pinned pool, side-stream copies (torch only).

Runs where a CUDA GPU exists; vLLM need not be installed (the tiered cache's copy code,
``connectors/flexkv/blocks.py`` and ``copier.py``, imports torch and numpy only, and the
script checks that vLLM stayed unimported):

1. Builds GPU KV caches in vLLM's FlashAttention layout (per layer ``[2, blocks, block_size,
   kv_heads, head]`` bf16, all layers views of one storage as vLLM's ``KVCacheTensor``),
   maps them with ``block_views`` and makes the connector's ``BlockCopier`` (the CPU pool
   pinned, copies on its own stream behind an event of the compute stream).
2. Saves ``--n`` scattered device blocks into the pinned pool, restores them into other
   scattered blocks (pool rows in order, then in a shuffled order), and verifies bytes: every
   restored block equals its source through torch's own indexing (K and V of every layer),
   and no other block changed.
3. Prints save / restore GB/s next to the floors: one plain pinned<->device ``copy_`` of the
   same number of bytes (contiguous, non_blocking, synchronized). Median of ``--rounds``.

Writes JSON to ``--out``, else ``$OUT/gpu_flexkv_tiers.json`` when ``$OUT`` is set, else
``benchmarks/results/gpu_flexkv_tiers.json``. Without CUDA it exits with status 2 and says so
(``--device cpu`` runs the same steps on CPU tensors, a smoke test whose numbers mean nothing).

    python benchmarks/gpu_flexkv_tiers.py --out $OUT/gpu_flexkv_tiers.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vllm_pd_ext.connectors.flexkv.blocks import block_views
from vllm_pd_ext.connectors.flexkv.copier import BlockCopier

VLLM_IMPORTED = any(m == "vllm" or m.startswith("vllm.") for m in sys.modules)


def flash_caches(layers, num_blocks, block_size, heads, head, dev) -> dict[str, torch.Tensor]:
    """Per-layer FlashAttention caches ``[2, blocks, block_size, heads, head]`` in one storage."""
    per_layer = 2 * num_blocks * block_size * heads * head
    g = torch.Generator(device=dev).manual_seed(0)
    buf = torch.randn(layers * per_layer, generator=g, device=dev).to(torch.bfloat16)
    return {
        f"model.layers.{i}.self_attn.attn": buf[i * per_layer : (i + 1) * per_layer].view(
            2, num_blocks, block_size, heads, head
        )
        for i in range(layers)
    }


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev, rounds: int) -> float:
    """Median seconds of ``fn`` (synchronized before and after)."""
    times = []
    for _ in range(rounds):
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=28, help="Qwen2.5-7B: 28 layers")
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--n", type=int, default=512, help="blocks saved and restored")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_flexkv_tiers: needs a CUDA GPU (torch.cuda.is_available() is False); "
            "nothing measured. --device cpu runs the same steps on CPU tensors as a smoke test.",
            file=sys.stderr,
        )
        return 2
    dev = torch.device(args.device)
    n = args.n
    num_blocks = 3 * n + 7
    caches = flash_caches(args.layers, num_blocks, args.block_size, args.kv_heads, args.head, dev)
    before = {k: v.clone() for k, v in caches.items()}
    views = block_views(
        caches, num_blocks=num_blocks, block_size=args.block_size, model={"bench": 1}
    )
    copier = BlockCopier(views, cpu_slots=n)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
    src, dst = perm[:n], perm[n : 2 * n]  # scattered, disjoint
    nbytes = n * copier.block_bytes
    rows = list(range(n))

    def save() -> None:
        copier.gather(src, copier.pool, rows, after=copier.compute_event())

    def restore() -> None:
        copier.scatter(dst, copier.pool, rows, after=copier.compute_event())

    t_save = timed(save, dev, args.rounds)
    t_restore = timed(restore, dev, args.rounds)
    ok_restore = all(torch.equal(c[:, dst], c[:, src]) for c in caches.values())
    others = sorted(set(range(num_blocks)) - set(dst))
    untouched = all(torch.equal(caches[k][:, others], before[k][:, others]) for k in caches)
    # shuffled pool rows: restore row j into block dst2[j] (runs of one, the scattered path)
    shuffle = torch.randperm(n, generator=torch.Generator().manual_seed(2)).tolist()
    dst2 = perm[2 * n : 3 * n]
    copier.scatter(dst2, copier.pool, shuffle, after=copier.compute_event())
    sync(dev)
    ok_shuffled = all(
        torch.equal(c[:, dst2], c[:, [src[j] for j in shuffle]]) for c in caches.values()
    )
    # the floors: one contiguous copy of the same bytes between pinned host and device memory
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    devbuf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    t_d2h = timed(lambda: host.copy_(devbuf, non_blocking=True), dev, args.rounds)
    t_h2d = timed(lambda: devbuf.copy_(host, non_blocking=True), dev, args.rounds)
    gbps = {
        "save_d2h": nbytes / t_save / 1e9,
        "restore_h2d": nbytes / t_restore / 1e9,
        "floor_d2h": nbytes / t_d2h / 1e9,
        "floor_h2d": nbytes / t_h2d / 1e9,
    }
    out = {
        "benchmark": "gpu_flexkv_tiers",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "vllm_imported": VLLM_IMPORTED,
        "pool_pinned": bool(copier.pool.is_pinned()) if dev.type == "cuda" else False,
        "side_stream": copier.stream is not None,
        "layout": "FlashAttention [2, blocks, block_size, kv_heads, head] bf16, one storage",
        "layers": args.layers,
        "block_size": args.block_size,
        "kv_heads": args.kv_heads,
        "head": args.head,
        "block_bytes": copier.block_bytes,
        "blocks": n,
        "MB": round(nbytes / 1e6, 1),
        "rounds": args.rounds,
        "GB_per_s": {k: round(v, 2) for k, v in gbps.items()},
        "save_vs_floor": round(gbps["save_d2h"] / gbps["floor_d2h"], 2),
        "restore_vs_floor": round(gbps["restore_h2d"] / gbps["floor_h2d"], 2),
        "verified": {
            "restored_equal_source": ok_restore,
            "other_blocks_untouched": untouched,
            "shuffled_rows_restore_equal": ok_shuffled,
        },
    }
    print(
        f"{out['machine']['device']}: {n} scattered blocks x {copier.block_bytes // 1024} KiB "
        f"= {out['MB']} MB, median of {args.rounds}; pinned pool {out['pool_pinned']}, "
        f"vLLM imported {VLLM_IMPORTED}"
    )
    print(f"{'path':<14}{'GB/s':>8}")
    for k, v in out["GB_per_s"].items():
        print(f"{k:<14}{v:>8}")
    print(
        f"save / floor {out['save_vs_floor']}  restore / floor {out['restore_vs_floor']}  "
        f"verified {out['verified']}"
    )
    if args.out:
        dest = Path(args.out)
    elif os.environ.get("OUT"):
        dest = Path(os.environ["OUT"]) / "gpu_flexkv_tiers.json"
    else:
        dest = Path(__file__).parent / "results" / "gpu_flexkv_tiers.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(out, indent=1) + "\n")
    return 0 if all(out["verified"].values()) and not VLLM_IMPORTED else 1


if __name__ == "__main__":
    sys.exit(main())
