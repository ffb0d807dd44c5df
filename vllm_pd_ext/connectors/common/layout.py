"""Where each KV block lives in a worker's registered caches, and spans between two workers.

A worker's KV caches arrive as ``{layer name: tensor}``. Each distinct tensor becomes one
transport region. Inside it, scheduler block ``b`` is ``len(piece_offsets)`` equal pieces of
``piece_len`` bytes at ``piece_offsets[i] + b * block_stride`` (one piece when the block
dimension comes first, as on vLLM's CPU backend ``[blocks, heads, block_size, 2*head]``; two
for ``[2, blocks, ...]`` K/V layouts). Copying block ``b`` of one worker into block ``c`` of
another is then a fixed set of ``(local offset, remote offset, length)`` spans per region.

:func:`layout_from_caches` runs in the worker; :class:`CacheLayout` travels in the handshake
and :meth:`CacheLayout.check_compatible` fails closed on any difference that would put bytes
in the wrong place.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch


class LayoutMismatch(ValueError):
    """Two workers' KV layouts differ in a way that makes a block copy wrong."""


@dataclass(frozen=True)
class CacheRegion:
    """One registered cache tensor: its memory extent and where each block's bytes are."""

    name: str
    layers: tuple[str, ...]
    addr: int
    size: int
    num_blocks: int
    block_stride: int
    piece_offsets: tuple[int, ...]
    piece_len: int
    dtype: str
    block_shape: tuple[int, ...]

    def shape_key(self) -> dict[str, Any]:
        """What must match on both sides (addresses and block counts may differ)."""
        return {
            "layers": list(self.layers),
            "dtype": self.dtype,
            "block_shape": list(self.block_shape),
            "pieces": len(self.piece_offsets),
            "piece_len": self.piece_len,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "layers": list(self.layers),
            "addr": self.addr,
            "size": self.size,
            "num_blocks": self.num_blocks,
            "block_stride": self.block_stride,
            "piece_offsets": list(self.piece_offsets),
            "piece_len": self.piece_len,
            "dtype": self.dtype,
            "block_shape": list(self.block_shape),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CacheRegion:
        return cls(
            name=str(d["name"]),
            layers=tuple(str(x) for x in d["layers"]),
            addr=int(d["addr"]),
            size=int(d["size"]),
            num_blocks=int(d["num_blocks"]),
            block_stride=int(d["block_stride"]),
            piece_offsets=tuple(int(x) for x in d["piece_offsets"]),
            piece_len=int(d["piece_len"]),
            dtype=str(d["dtype"]),
            block_shape=tuple(int(x) for x in d["block_shape"]),
        )


@dataclass(frozen=True)
class CacheLayout:
    """All regions of one worker plus what the model and engine must agree on."""

    regions: tuple[CacheRegion, ...]
    block_size: int
    model: Mapping[str, Any]

    def fingerprint(self) -> str:
        """A short hash of everything :meth:`check_compatible` compares."""
        key = {
            "block_size": self.block_size,
            "model": dict(self.model),
            "regions": [r.shape_key() for r in self.regions],
        }
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]

    def check_compatible(self, remote: CacheLayout) -> None:
        """Raise :class:`LayoutMismatch` naming the first difference from ``remote``."""
        if self.block_size != remote.block_size:
            raise LayoutMismatch(f"block size {self.block_size} here, {remote.block_size} remote")
        for key in sorted(set(self.model) | set(remote.model)):
            if self.model.get(key) != remote.model.get(key):
                raise LayoutMismatch(
                    f"model {key}: {self.model.get(key)!r} here, {remote.model.get(key)!r} remote"
                )
        if len(self.regions) != len(remote.regions):
            raise LayoutMismatch(
                f"{len(self.regions)} KV cache tensors here, {len(remote.regions)} remote"
            )
        for mine, theirs in zip(self.regions, remote.regions, strict=True):
            a, b = mine.shape_key(), theirs.shape_key()
            for key in a:
                if a[key] != b[key]:
                    raise LayoutMismatch(
                        f"KV cache {mine.name} ({mine.layers[0]}...) {key}: {a[key]!r} here, "
                        f"{b[key]!r} remote"
                    )

    def to_dict(self) -> dict[str, Any]:
        return {
            "block_size": self.block_size,
            "model": dict(self.model),
            "regions": [r.to_dict() for r in self.regions],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CacheLayout:
        try:
            return cls(
                regions=tuple(CacheRegion.from_dict(r) for r in d["regions"]),
                block_size=int(d["block_size"]),
                model=dict(d["model"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise LayoutMismatch(f"malformed KV layout from peer: {e}") from e


def _region_of(name: str, layers: tuple[str, ...], t: torch.Tensor, num_blocks: int) -> CacheRegion:
    shape, stride = tuple(t.shape), tuple(t.stride())
    candidates = [d for d, n in enumerate(shape) if n == num_blocks]
    if not candidates:
        raise LayoutMismatch(
            f"KV cache of {layers[0]} has shape {shape}: no dimension of {num_blocks} blocks"
        )
    # [blocks, ...] (CPU backend) or [2, blocks, ...] (K/V split first)
    d = 1 if len(candidates) > 1 and shape[0] == 2 and 1 in candidates else candidates[0]
    elem = t.element_size()
    inner_shape, inner_stride = shape[d + 1 :], stride[d + 1 :]
    expected = 1
    for n, s in reversed(list(zip(inner_shape, inner_stride, strict=True))):
        if n != 1 and s != expected:
            raise LayoutMismatch(
                f"KV cache of {layers[0]} (shape {shape}, stride {stride}) is not contiguous "
                f"inside a block"
            )
        expected *= n
    piece_len = expected * elem
    offsets = [0]
    for n, s in zip(shape[:d], stride[:d], strict=True):
        offsets = [o + i * s * elem for o in offsets for i in range(n)]
    extent = (sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) + 1) * elem
    return CacheRegion(
        name=name,
        layers=layers,
        addr=int(t.data_ptr()),
        size=int(extent),
        num_blocks=num_blocks,
        block_stride=stride[d] * elem,
        piece_offsets=tuple(offsets),
        piece_len=piece_len,
        dtype=str(t.dtype).removeprefix("torch."),
        block_shape=shape[:d] + shape[d + 1 :],
    )


def layout_from_caches(
    kv_caches: Mapping[str, torch.Tensor],
    *,
    num_blocks: int,
    block_size: int,
    model: Mapping[str, Any],
) -> tuple[CacheLayout, dict[str, torch.Tensor]]:
    """The layout of a worker's caches and the tensors to register, one per region.

    Layers sharing one tensor (same address, shape and strides) share a region. Regions are
    named ``kv0``, ``kv1``... in layer-name order, so both sides name them alike.
    """
    groups: dict[tuple[int, tuple[int, ...], tuple[int, ...]], list[str]] = {}
    tensors: dict[tuple[int, tuple[int, ...], tuple[int, ...]], torch.Tensor] = {}
    for layer in sorted(kv_caches):
        t = kv_caches[layer]
        key = (int(t.data_ptr()), tuple(t.shape), tuple(t.stride()))
        groups.setdefault(key, []).append(layer)
        tensors[key] = t
    regions, by_name = [], {}
    for i, key in enumerate(groups):
        name = f"kv{i}"
        regions.append(_region_of(name, tuple(groups[key]), tensors[key], num_blocks))
        by_name[name] = tensors[key]
    layout = CacheLayout(regions=tuple(regions), block_size=block_size, model=dict(model))
    return layout, by_name


def block_spans(
    local: CacheRegion, remote: CacheRegion, pairs: Sequence[tuple[int, int]]
) -> np.ndarray:
    """``(local offset, remote offset, length)`` rows moving block ``pairs[i] = (l, r)``.

    Offsets are relative to each region's start. Block ids outside either region raise
    :class:`LayoutMismatch` (never a span into another block's memory).
    """
    p = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    if p.size and (
        p.min() < 0 or p[:, 0].max() >= local.num_blocks or p[:, 1].max() >= remote.num_blocks
    ):
        raise LayoutMismatch(
            f"block ids out of range (local < {local.num_blocks}, remote < {remote.num_blocks})"
        )
    lo = np.asarray(local.piece_offsets, dtype=np.int64)
    ro = np.asarray(remote.piece_offsets, dtype=np.int64)
    out = np.empty((len(p) * len(lo), 3), dtype=np.int64)
    out[:, 0] = (p[:, 0:1] * local.block_stride + lo[None, :]).reshape(-1)
    out[:, 1] = (p[:, 1:2] * remote.block_stride + ro[None, :]).reshape(-1)
    out[:, 2] = local.piece_len
    return out
