"""Row views of vLLM's KV cache, one row per block, for the tiered cache's block copies.

Where each block lies is :func:`~vllm_pd_ext.connectors.common.layout.layout_from_caches`'s
job (the layout our P/D connectors use too): per cache tensor, block ``b`` is
``len(piece_offsets)`` equal pieces of ``piece_len`` bytes at
``offset + piece_offset + b * block_stride`` in its storage. :func:`block_views` turns every
piece into a ``[num_blocks, piece_len]`` view of that storage, so copying a set of blocks is
one ``index_select`` / ``index_copy_`` per piece whatever the attention backend's shape. A
block's bytes in the CPU tier and in block files are these pieces concatenated in view order;
the layout's fingerprint is stored with every block file, so blocks written under another
layout (model, block size, dtype, tensor shapes, piece split) are never read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vllm_pd_ext.connectors.common.layout import layout_from_caches


@dataclass(frozen=True)
class BlockView:
    """One piece of every block: ``view[b]`` is block ``b``'s ``length`` bytes, at byte
    ``column`` of a tier row."""

    view: torch.Tensor
    column: int
    length: int


@dataclass(frozen=True)
class BlockViews:
    """Every piece of a worker's KV cache, the bytes of one block, and the layout's id."""

    views: tuple[BlockView, ...]
    block_bytes: int
    fingerprint: str


_WIDE = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def block_views(
    kv_caches: Mapping[str, Any], *, num_blocks: int, block_size: int, model: Mapping[str, Any]
) -> BlockViews:
    """Views over every distinct cache tensor of a model with one KV cache group
    (:func:`group_block_views` with every layer in group 0)."""
    return group_block_views(
        kv_caches, num_blocks=num_blocks, block_sizes=(block_size,), model=model
    )[0]


def group_block_views(
    kv_caches: Mapping[str, Any],
    *,
    num_blocks: int,
    block_sizes: Sequence[int],
    model: Mapping[str, Any],
    group_of: Mapping[str, int] | None = None,
) -> tuple[BlockViews, ...]:
    """Views over every distinct cache tensor (layers sharing one tensor count once), one
    :class:`BlockViews` per KV cache group (``group_of``: layer name -> group, all group 0
    when omitted). Under vLLM's hybrid allocator the groups' blocks share storage, and a
    block of a group is only that group's pieces (attention K/V of its layers, or a whole
    Mamba state page); every group's views carry the fingerprint of the whole layout.

    Views use the widest integer element dividing every piece's offset, length and stride
    and every storage's size (copies of int64 rows are several times faster than of bytes);
    ``column`` and ``length`` stay in bytes. Raises ``LayoutMismatch`` for a cache whose
    blocks are not a fixed set of contiguous byte pieces.
    """
    layout, storages = layout_from_caches(
        kv_caches,
        num_blocks=num_blocks,
        block_sizes=tuple(block_sizes),
        model=model,
        group_of=group_of,
    )
    starts = [(v, v.offset + p) for v in layout.views for p in v.piece_offsets]
    width, dtype = next(
        (w, d)
        for w, d in _WIDE
        if all(x % w == 0 for v, at in starts for x in (at, v.piece_len, v.block_stride))
        and all(r.size % w == 0 for r in layout.regions)
    )
    regions = {name: t.view(dtype) for name, t in storages.items()}
    groups = max([len(block_sizes), *(v.group + 1 for v in layout.views)])
    out: list[list[BlockView]] = [[] for _ in range(groups)]
    columns = [0] * groups
    for v, at in starts:
        rows = torch.as_strided(
            regions[v.region],
            (v.num_blocks, v.piece_len // width),
            (v.block_stride // width, 1),
            at // width,
        )
        out[v.group].append(BlockView(rows, columns[v.group], v.piece_len))
        columns[v.group] += v.piece_len
    fingerprint = layout.fingerprint()
    return tuple(
        BlockViews(tuple(views), column, fingerprint)
        for views, column in zip(out, columns, strict=True)
    )


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
