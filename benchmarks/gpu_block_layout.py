"""GPU check of the connectors' block layout and of host staging bandwidth (torch only).

Runs where a CUDA GPU exists (vLLM need not be installed):

1. Builds KV caches shaped like vLLM's CUDA backends in GPU memory (FlashAttention
   ``[2, blocks, block_size, heads, head]`` per layer, all layers in one storage as vLLM's
   ``KVCacheTensor`` does, and a hybrid page shared by a Mamba state view and an attention view),
   maps them with :func:`vllm_pd_ext.connectors.common.layout.layout_from_caches`, copies a set
   of block pairs span by span through byte views of the registered storages, and checks the
   result against torch's own block indexing. This is what a transport does with the spans.
2. Measures device-to-host and host-to-device copies of scattered 16 KiB blocks (Qwen2.5-7B
   shape, 28 layers) through pageable and pinned staging buffers: the numbers a CPU tier or a
   TCP transport staging through host memory would see.

Writes ``benchmarks/results/gpu_block_layout.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vllm_pd_ext.connectors.common.layout import block_spans, layout_from_caches


def flash_caches(num_blocks: int, layers: int, dev: str, seed: int | None):
    """Per-layer FlashAttention caches as views into one storage (vLLM's KVCacheTensor)."""
    per_layer = 2 * num_blocks * 16 * 4 * 128
    dtype = torch.bfloat16
    buf = torch.zeros(layers * per_layer, dtype=dtype, device=dev)
    if seed is not None:
        g = torch.Generator(device=dev).manual_seed(seed)
        buf.copy_(torch.randn(buf.shape, generator=g, device=dev, dtype=torch.float32).to(dtype))
    return {
        f"model.layers.{i}.self_attn.attn": buf[i * per_layer : (i + 1) * per_layer].view(
            2, num_blocks, 16, 4, 128
        )
        for i in range(layers)
    }


def hybrid_caches(num_blocks: int, dev: str, seed: int | None):
    """A shared page per block: a Mamba state view (int8) and an attention view (bf16)."""
    page = 16384
    buf = torch.zeros(num_blocks * page, dtype=torch.uint8, device=dev)
    if seed is not None:
        g = torch.Generator(device=dev).manual_seed(seed)
        buf.copy_(torch.randint(0, 256, buf.shape, generator=g, device=dev, dtype=torch.uint8))
    state = torch.as_strided(buf.view(torch.int8), (num_blocks, 1, 1, 9600), (page, 9600, 9600, 1))
    attn = torch.as_strided(
        buf.view(torch.bfloat16), (num_blocks, 2, 16, 128), (page // 2, 16 * 128, 128, 1)
    )
    return {"model.layers.0.mixer": state, "model.layers.1.attn": attn}


def copy_by_spans(src, dst, groups, pairs, num_blocks):
    """Move ``pairs[g]`` (dst block, src block) of every view through span byte copies."""
    lsrc, ssrc = layout_from_caches(
        src, num_blocks=num_blocks, block_sizes=(16, 16), model={}, group_of=groups
    )
    ldst, sdst = layout_from_caches(
        dst, num_blocks=num_blocks, block_sizes=(16, 16), model={}, group_of=groups
    )
    ldst.check_compatible(lsrc)
    n = 0
    for mine, theirs in zip(ldst.views, lsrc.views, strict=True):
        spans = block_spans(mine, theirs, pairs[mine.group])
        d, s = sdst[mine.region], ssrc[theirs.region]
        for lo, ro, length in spans.tolist():
            d[lo : lo + length].copy_(s[ro : ro + length])
            n += 1
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return n


def check_layouts(dev: str) -> dict:
    nb = 64
    out = {}
    src, dst = flash_caches(nb, 4, dev, seed=1), flash_caches(nb, 4, dev, seed=None)
    pairs = [(5, 40), (6, 41), (20, 3), (63, 0)]
    spans = copy_by_spans(src, dst, {}, (pairs,), nb)
    ok = all(
        torch.equal(dst[k][:, d].view(torch.int16), src[k][:, s].view(torch.int16))
        for k in src
        for d, s in pairs
    )
    untouched = all(
        torch.count_nonzero(dst[k][:, b].view(torch.int16)) == 0
        for k in dst
        for b in range(nb)
        if b not in dict(pairs)
    )
    out["flash_attention_shared_storage"] = {
        "spans": spans,
        "blocks_equal": ok,
        "others_untouched": bool(untouched),
    }
    groups = {"model.layers.0.mixer": 0, "model.layers.1.attn": 1}
    src, dst = hybrid_caches(nb, dev, seed=2), hybrid_caches(nb, dev, seed=None)
    per_group = ([(9, 2)], [(10, 3), (11, 4)])
    spans = copy_by_spans(src, dst, groups, per_group, nb)
    ok = torch.equal(dst["model.layers.0.mixer"][9], src["model.layers.0.mixer"][2]) and all(
        torch.equal(
            dst["model.layers.1.attn"][d].view(torch.int16),
            src["model.layers.1.attn"][s].view(torch.int16),
        )
        for d, s in per_group[1]
    )
    out["hybrid_shared_pages"] = {"spans": spans, "blocks_equal": bool(ok)}
    return out


def staging_bandwidth(dev: str, tokens: int) -> dict:
    """Gather scattered blocks of 28 layers into host memory and back (GB/s)."""
    layers, nb = 28, tokens // 16 * 2
    caches = torch.randn(layers, 2, nb, 16 * 4 * 128, device=dev).to(torch.bfloat16)
    idx = torch.randperm(nb, device=dev)[: tokens // 16]
    nbytes = layers * 2 * len(idx) * 16 * 4 * 128 * 2
    res = {}
    for pinned in (False, True):
        host = torch.empty(
            (layers, 2, len(idx), 16 * 4 * 128), dtype=torch.bfloat16, pin_memory=pinned
        )
        for direction in ("d2h", "h2d"):
            times = []
            for _ in range(5):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                if direction == "d2h":
                    host.copy_(caches.index_select(2, idx), non_blocking=pinned)
                else:
                    caches.index_copy_(2, idx, host.to(dev, non_blocking=pinned))
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            res[f"{'pinned' if pinned else 'pageable'}_{direction}_GBps"] = round(
                nbytes / sorted(times)[2] / 1e9, 2
            )
    return {"tokens": tokens, "bytes": nbytes, **res}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "gpu_block_layout.json"
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU here: nothing to check", file=sys.stderr)
        return 2
    dev = "cuda"
    result: dict[str, Any] = {
        "benchmark": "gpu_block_layout",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            "gpu": torch.cuda.get_device_name(0),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "layout": check_layouts(dev),
        "staging": [staging_bandwidth(dev, t) for t in (1024, 8192, 32768)],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    layout_ok = all(
        v.get("blocks_equal") and v.get("others_untouched", True) for v in result["layout"].values()
    )
    return 0 if layout_ok else 1


if __name__ == "__main__":
    sys.exit(main())
