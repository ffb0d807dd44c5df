"""Byte views of vLLM's KV cache tensors, one row per block, for block copies.

A worker's caches arrive as ``{layer name: tensor}``. In each distinct tensor, block ``b``
is one or more equal byte pieces at ``piece_offset + b * block_stride`` (one piece when the
block dimension comes first, as on vLLM's CPU backend ``[blocks, heads, block_size, 2*head]``;
two for ``[2, blocks, ...]`` K/V layouts). :func:`block_views` turns each piece into a
``[num_blocks, piece_len]`` uint8 view, so copying a set of blocks is one ``index_select`` /
``index_copy_`` per view whatever the attention backend's shape. A block's bytes in the CPU
tier and in block files are these pieces, concatenated in view order.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch


class UnsupportedLayout(ValueError):
    """A KV cache tensor whose blocks are not a fixed set of contiguous byte pieces."""


@dataclass(frozen=True)
class BlockView:
    """One piece of every block: ``view[b]`` is block ``b``'s ``length`` bytes."""

    view: torch.Tensor
    column: int
    length: int
    describe: tuple[Any, ...]


def _pieces(t: torch.Tensor, num_blocks: int) -> tuple[int, list[int], int, int]:
    """(block dim, piece offsets in bytes, piece length, block stride in bytes)."""
    shape, stride, elem = tuple(t.shape), tuple(t.stride()), t.element_size()
    dims = [d for d, n in enumerate(shape) if n == num_blocks]
    if not dims:
        raise UnsupportedLayout(
            f"KV cache of shape {shape} has no dimension of {num_blocks} blocks"
        )
    d = 1 if len(dims) > 1 and shape[0] == 2 and 1 in dims else dims[0]
    expected = 1
    for n, s in reversed(list(zip(shape[d + 1 :], stride[d + 1 :], strict=True))):
        if n != 1 and s != expected:
            raise UnsupportedLayout(
                f"KV cache (shape {shape}, stride {stride}) is not contiguous inside a block"
            )
        expected *= n
    offsets = [0]
    for n, s in zip(shape[:d], stride[:d], strict=True):
        offsets = [o + i * s * elem for o in offsets for i in range(n)]
    return d, offsets, expected * elem, stride[d] * elem


_WIDE = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def block_views(kv_caches: Mapping[str, torch.Tensor], num_blocks: int) -> list[BlockView]:
    """Views over every distinct cache tensor (layers sharing one tensor count once).

    Views use the widest integer element that divides every piece's offset, length and
    stride (copies of int64 rows are several times faster than of bytes); ``column`` and
    ``length`` stay in bytes.
    """
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    pieces: list[tuple[torch.Tensor, str, int, int, int, int]] = []
    for layer in sorted(kv_caches):
        t = kv_caches[layer]
        key = (int(t.data_ptr()), tuple(t.shape), tuple(t.stride()))
        if key in seen:
            continue
        seen.add(key)
        _, offsets, length, bstride = _pieces(t, num_blocks)
        start = t.storage_offset() * t.element_size()
        pieces += [(t, layer, start + off, off, length, bstride) for off in offsets]
    width, dtype = next(
        (w, d)
        for w, d in _WIDE
        if all(x % w == 0 for _, _, at, _, n, st in pieces for x in (at, n, st))
    )
    out: list[BlockView] = []
    column = 0
    for t, layer, at, off, length, bstride in pieces:
        base = torch.empty(0, dtype=dtype, device=t.device).set_(t.untyped_storage())
        view = torch.as_strided(
            base, (num_blocks, length // width), (bstride // width, 1), at // width
        )
        desc = (layer, str(t.dtype), tuple(t.shape), off, length)
        out.append(BlockView(view, column, length, desc))
        column += length
    return out


def layout_fingerprint(views: list[BlockView], model: Mapping[str, Any]) -> str:
    """16 hex characters naming the block byte layout: files from another layout are refused."""
    doc = {"model": dict(model), "views": [[str(x) for x in v.describe[1:]] for v in views]}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def model_facts(vllm_config: Any) -> dict[str, Any]:
    """What two engines must agree on to share KV blocks (part of the cache namespace)."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    return {
        "model": str(mc.model),
        "architectures": list(getattr(mc.hf_config, "architectures", None) or []),
        "layers": mc.get_num_layers(pc),
        "kv_heads": mc.get_num_kv_heads(pc),
        "head_size": mc.get_head_size(),
        "dtype": str(mc.dtype),
        "cache_dtype": str(vllm_config.cache_config.cache_dtype),
        "tp_size": pc.tensor_parallel_size,
    }
