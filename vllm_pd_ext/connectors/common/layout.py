"""Where each KV block lives in a worker's registered caches, and spans between two workers.

A worker's KV caches arrive as ``{layer name: tensor}`` (or a list of tensors per layer). Each
distinct underlying storage becomes one transport **region**; several layers, and under vLLM's
hybrid allocator layers of different KV cache groups, may share one. Each distinct tensor is a
**view**: it belongs to one KV cache group, and inside its region block ``b`` of that group is
``len(piece_offsets)`` equal pieces of ``piece_len`` bytes at
``offset + piece_offsets[i] + b * block_stride`` (one piece when the block dimension comes first,
as on vLLM's CPU backend ``[blocks, heads, block_size, 2*head]`` or a Mamba state page; two for
``[2, blocks, ...]`` K/V layouts).

Copying block ``b`` of a group on one worker into block ``c`` on another is then a fixed set of
``(local offset, remote offset, length)`` spans per view. A view whose pieces start with the KV
heads dimension (``heads`` > 0: vLLM's head-major layout, as on the CPU backend) holds each
head's bytes contiguously in each piece, so a slice of heads is one span per piece: that is
what moves between engines of different tensor parallel sizes (``parallel.py``). A Mamba2
state page (``state``: :class:`~.parallel.Mamba2State`) is split by heads in four parts; the
spans of each part a rank holds move instead (:func:`state_block_spans`).
:func:`layout_from_caches` runs in the worker; :class:`CacheLayout` travels in the handshake and
:meth:`CacheLayout.check_compatible` fails closed on any difference that would put bytes in
the wrong place.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from vllm_pd_ext.connectors.common.parallel import HeadSlice, Mamba2State, state_refusal

if TYPE_CHECKING:
    import torch


class LayoutMismatch(ValueError):
    """Two workers' KV layouts differ in a way that makes a block copy wrong."""


@dataclass(frozen=True)
class MemoryRegion:
    """One registered storage: ``size`` bytes at ``addr``."""

    name: str
    addr: int
    size: int


@dataclass(frozen=True)
class CacheView:
    """One cache tensor inside a region: where each block of its group lies."""

    layers: tuple[str, ...]
    group: int
    region: str
    offset: int
    num_blocks: int
    block_stride: int
    piece_offsets: tuple[int, ...]
    piece_len: int
    dtype: str
    block_shape: tuple[int, ...]
    #: KV heads of this rank in each piece's outermost dimension (``block_shape[heads_axis]``);
    #: 0: the pieces are not split by heads (or not head-major), so no head slice is
    #: addressable.
    heads: int = 0
    heads_axis: int = -1
    #: This rank's Mamba2 state in each block (one piece, the state's bytes at its start), or
    #: None: a slice of it is not addressable.
    state: Mamba2State | None = None

    @property
    def head_len(self) -> int:
        """Bytes of one head in one piece (``heads`` > 0 only)."""
        return self.piece_len // self.heads

    def shape_key(self) -> dict[str, Any]:
        """What must match on both sides (addresses and block counts may differ); ``heads``
        only where known (so a layout without it keeps its fingerprint)."""
        key: dict[str, Any] = {
            "layers": list(self.layers),
            "group": self.group,
            "dtype": self.dtype,
            "block_shape": list(self.block_shape),
            "pieces": len(self.piece_offsets),
            "piece_len": self.piece_len,
        }
        if self.heads:
            key["heads"] = self.heads
        return key

    def split_key(self) -> dict[str, Any]:
        """What must match between engines of different TP sizes (besides the total heads)."""
        rest = list(self.block_shape)
        if self.heads:
            del rest[self.heads_axis]
        return {
            "layers": list(self.layers),
            "group": self.group,
            "dtype": self.dtype,
            "pieces": len(self.piece_offsets),
            "heads_axis": self.heads_axis,
            "shape_per_head": rest,
            "head_len": self.head_len if self.heads else None,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.shape_key(),
            "heads": self.heads,
            "region": self.region,
            "offset": self.offset,
            "num_blocks": self.num_blocks,
            "block_stride": self.block_stride,
            "piece_offsets": list(self.piece_offsets),
            "heads_axis": self.heads_axis,
            **({"state": self.state.to_dict()} if self.state is not None else {}),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CacheView:
        return cls(
            layers=tuple(str(x) for x in d["layers"]),
            group=int(d["group"]),
            region=str(d["region"]),
            offset=int(d["offset"]),
            num_blocks=int(d["num_blocks"]),
            block_stride=int(d["block_stride"]),
            piece_offsets=tuple(int(x) for x in d["piece_offsets"]),
            piece_len=int(d["piece_len"]),
            dtype=str(d["dtype"]),
            block_shape=tuple(int(x) for x in d["block_shape"]),
            heads=int(d.get("heads", 0)),
            heads_axis=int(d.get("heads_axis", -1)),
            state=Mamba2State.from_dict(d["state"]) if d.get("state") else None,
        )


#: Model facts that differ between engines of different tensor parallel sizes: compared only
#: when the sizes are equal (per-rank head counts: ``CacheView.heads`` times the TP size).
_PER_RANK_FACTS = ("tp_size",)
_PER_RANK_GROUP_FACTS = ("num_kv_heads", "shapes")


def _tp_free(key: str, value: Any) -> Any:
    """Model fact ``key`` without what depends on the TP size."""
    if key in _PER_RANK_FACTS:
        return None
    if key == "groups" and isinstance(value, list):
        return [
            {k: v for k, v in g.items() if k not in _PER_RANK_GROUP_FACTS}
            if isinstance(g, Mapping)
            else g
            for g in value
        ]
    return value


@dataclass(frozen=True)
class CacheLayout:
    """All regions and views of one worker, the groups' block sizes, model facts, and the
    worker's tensor parallel size and rank."""

    regions: tuple[MemoryRegion, ...]
    views: tuple[CacheView, ...]
    block_sizes: tuple[int, ...]
    model: Mapping[str, Any]
    tp_size: int = 1
    tp_rank: int = 0

    def fingerprint(self) -> str:
        """A short hash of everything :meth:`check_compatible` compares."""
        key = {
            "block_sizes": list(self.block_sizes),
            "model": dict(self.model),
            "views": [v.shape_key() for v in self.views],
        }
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]

    def check_compatible(self, remote: CacheLayout) -> None:
        """Raise :class:`LayoutMismatch` naming the first difference from ``remote``. Of
        different TP sizes, every view must be head-major on both sides, with the same total
        heads and the same bytes per head (a slice of heads is then addressable), or a Mamba2
        state page on both sides that :func:`~.parallel.state_refusal` accepts."""
        split = self.tp_size != remote.tp_size
        if list(self.block_sizes) != list(remote.block_sizes):
            raise LayoutMismatch(
                f"block sizes per KV cache group {list(self.block_sizes)} here, "
                f"{list(remote.block_sizes)} remote"
            )
        for key in sorted(set(self.model) | set(remote.model)):
            a, b = self.model.get(key), remote.model.get(key)
            if split:
                a, b = _tp_free(key, a), _tp_free(key, b)
            if a != b:
                raise LayoutMismatch(
                    f"model {key}: {self.model.get(key)!r} here, {remote.model.get(key)!r} remote"
                )
        if len(self.views) != len(remote.views):
            raise LayoutMismatch(
                f"{len(self.views)} KV cache tensors here, {len(remote.views)} remote"
            )
        for mine, theirs in zip(self.views, remote.views, strict=True):
            if split:
                self._check_split(mine, theirs, remote.tp_size)
                continue
            a, b = mine.shape_key(), theirs.shape_key()
            for key in a | b:
                if a.get(key) != b.get(key):
                    raise LayoutMismatch(
                        f"KV cache of {mine.layers[0]} {key}: {a.get(key)!r} here, "
                        f"{b.get(key)!r} remote"
                    )

    def _check_split(self, mine: CacheView, theirs: CacheView, remote_tp: int) -> None:
        where = f"KV cache of {mine.layers[0]}"
        if mine.state is not None or theirs.state is not None:
            self._check_state_split(mine, theirs, remote_tp)
            return
        for view, side, tp in ((mine, "here", self.tp_size), (theirs, "remote", remote_tp)):
            if not view.heads:
                raise LayoutMismatch(
                    f"tensor parallel sizes differ (TP {self.tp_size} here, {remote_tp} "
                    f"remote) and the {where} {side} (block shape {list(view.block_shape)}, "
                    f"TP {tp}) is not head-major, so a slice of its heads is not one span per "
                    "block: use the same --tensor-parallel-size on both sides"
                )
        total, remote_total = mine.heads * self.tp_size, theirs.heads * remote_tp
        if total != remote_total:
            raise LayoutMismatch(
                f"{where} holds {total} KV heads in all here ({mine.heads} x TP "
                f"{self.tp_size}), {remote_total} remote ({theirs.heads} x TP {remote_tp})"
            )
        a, b = mine.split_key(), theirs.split_key()
        for key in a:
            if a[key] != b[key]:
                raise LayoutMismatch(f"{where} {key}: {a[key]!r} here, {b[key]!r} remote")

    def _check_state_split(self, mine: CacheView, theirs: CacheView, remote_tp: int) -> None:
        where = f"state of {mine.layers[0]}"
        if mine.state is None or theirs.state is None:
            side = "here" if mine.state is None else "remote"
            raise LayoutMismatch(
                f"tensor parallel sizes differ (TP {self.tp_size} here, {remote_tp} remote) "
                f"and the {where} {side} is not a Mamba2 state page split by heads: use the "
                "same --tensor-parallel-size on both sides"
            )
        sides = (("here", mine, self.tp_size), ("remote", theirs, remote_tp))
        for side, view, tp in sides:
            s = view.state
            assert s is not None
            if s.tp_size != tp:
                raise LayoutMismatch(f"{where} {side} is described for TP {s.tp_size}, not {tp}")
            sizes = (s.heads, s.head_dim, s.state_size, s.groups, s.conv_rows)
            if min(*sizes, s.conv_itemsize, s.ssm_itemsize) < 1 or view.piece_len < s.page_bytes:
                raise LayoutMismatch(
                    f"{where} {side}: sizes {sizes} in pieces of {view.piece_len} bytes are not "
                    "a Mamba2 state page"
                )
        if refusal := state_refusal(mine.state, theirs.state):
            raise LayoutMismatch(f"{where}: {refusal}")
        for key in ("layers", "group", "piece_offsets"):
            a, b = getattr(mine, key), getattr(theirs, key)
            if key == "piece_offsets":
                a, b = len(a), len(b)
            if a != b:
                raise LayoutMismatch(f"{where} {key}: {a!r} here, {b!r} remote")

    def to_dict(self) -> dict[str, Any]:
        return {
            "tp_size": self.tp_size,
            "tp_rank": self.tp_rank,
            "block_sizes": list(self.block_sizes),
            "model": dict(self.model),
            "regions": [[r.name, r.addr, r.size] for r in self.regions],
            "views": [v.to_dict() for v in self.views],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CacheLayout:
        try:
            return cls(
                regions=tuple(MemoryRegion(str(n), int(a), int(s)) for n, a, s in d["regions"]),
                views=tuple(CacheView.from_dict(v) for v in d["views"]),
                block_sizes=tuple(int(b) for b in d["block_sizes"]),
                model=dict(d["model"]),
                tp_size=int(d.get("tp_size", 1)),
                tp_rank=int(d.get("tp_rank", 0)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise LayoutMismatch(f"malformed KV layout from peer: {e}") from e


def _view_of(
    layers: tuple[str, ...],
    group: int,
    region: str,
    base: int,
    t: torch.Tensor,
    num_blocks: int,
    heads: int = 0,
    block_size: int = 0,
    heads_first: bool = False,
) -> CacheView:
    shape, stride = tuple(t.shape), tuple(t.stride())
    candidates = [d for d, n in enumerate(shape) if n == num_blocks]
    if not candidates:
        raise LayoutMismatch(
            f"KV cache of {layers[0]} has shape {shape}: no dimension of {num_blocks} blocks"
        )
    # [blocks, ...] (CPU backend, Mamba pages) or [2, blocks, ...] (K/V split first)
    d = 1 if len(candidates) > 1 and shape[0] == 2 and 1 in candidates else candidates[0]
    elem = t.element_size()
    expected = 1
    for n, s in reversed(list(zip(shape[d + 1 :], stride[d + 1 :], strict=True))):
        if n != 1 and s != expected:
            raise LayoutMismatch(
                f"KV cache of {layers[0]} (shape {shape}, stride {stride}) is not contiguous "
                f"inside a block"
            )
        expected *= n
    # head-major pieces: [heads, block_size, ...] with the heads the caller says this rank has;
    # with as many heads as tokens per block the shape cannot tell [heads, block_size, ...]
    # from [block_size, heads, ...]: only the engine's declared layout can (``heads_first``)
    head_major = (
        heads > 0
        and len(shape) > d + 2
        and shape[d + 1] == heads
        and (not block_size or shape[d + 2] == block_size)
        and (heads_first or heads != shape[d + 2])
    )
    offsets = [0]
    for n, s in zip(shape[:d], stride[:d], strict=True):
        offsets = [o + i * s * elem for o in offsets for i in range(n)]
    return CacheView(
        layers=layers,
        group=group,
        region=region,
        offset=int(t.data_ptr()) - base,
        num_blocks=num_blocks,
        block_stride=stride[d] * elem,
        piece_offsets=tuple(offsets),
        piece_len=expected * elem,
        dtype=str(t.dtype).removeprefix("torch."),
        block_shape=shape[:d] + shape[d + 1 :],
        heads=heads if head_major else 0,
        heads_axis=d if head_major else -1,
    )


def layer_groups(kv_cache_config: Any) -> dict[str, int]:
    """Layer name -> index of its KV cache group in vLLM's ``KVCacheConfig`` (empty for
    None: every layer in group 0)."""
    out: dict[str, int] = {}
    for i, g in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or ()):
        out.update(dict.fromkeys(g.layer_names, i))
    return out


def layout_from_caches(
    kv_caches: Mapping[str, Any],
    *,
    num_blocks: int,
    block_sizes: Sequence[int] = (),
    model: Mapping[str, Any],
    group_of: Mapping[str, int] | None = None,
    block_size: int | None = None,
    head_major: Mapping[int, int] | None = None,
    heads_first: bool = False,
    states: Mapping[int, Mamba2State] | None = None,
    tp_size: int = 1,
    tp_rank: int = 0,
) -> tuple[CacheLayout, dict[str, torch.Tensor]]:
    """The layout of a worker's caches and, per region name, a byte tensor over its storage.

    ``kv_caches`` values are tensors or lists of tensors; ``group_of`` maps layer names to KV
    cache groups (all group 0 when omitted; ``block_size`` is shorthand for one group's
    ``block_sizes``). ``head_major`` maps the groups whose blocks are laid out heads first
    (``[heads, block_size, ...]`` per piece) to this rank's KV heads; their views get
    ``heads`` where the tensor's shape shows them there. A shape with as many heads as
    tokens per block is ambiguous (``[heads, block_size, ...]`` or ``[block_size, heads,
    ...]``): head-major only when ``heads_first`` says the engine's declared KV cache layout
    puts each block's heads before its tokens, else not (no slice of heads is then read).
    ``states`` maps the groups of Mamba2 state pages to this rank's state: their views get
    ``state`` where each block is one piece that holds it.
    Regions are named ``kv0``, ``kv1``... and views ordered by layer name, so both sides name
    them alike.
    """
    import torch

    if block_size is not None:
        block_sizes = (block_size,)

    regions: dict[tuple[int, int], MemoryRegion] = {}
    storages: dict[str, torch.Tensor] = {}
    views: dict[tuple, list[str]] = {}
    tensors: dict[tuple, tuple[torch.Tensor, str, int]] = {}
    for layer in sorted(kv_caches):
        value = kv_caches[layer]
        group = (group_of or {}).get(layer, 0)
        for t in value if isinstance(value, list | tuple) else [value]:
            storage = t.untyped_storage()
            skey = (int(storage.data_ptr()), int(storage.nbytes()))
            if skey not in regions:
                name = f"kv{len(regions)}"
                regions[skey] = MemoryRegion(name, *skey)
                byte_view = torch.empty(0, dtype=torch.uint8, device=t.device)
                storages[name] = byte_view.set_(storage, 0, (skey[1],))
            vkey = (int(t.data_ptr()), tuple(t.shape), tuple(t.stride()), group)
            views.setdefault(vkey, []).append(layer)
            tensors[vkey] = (t, regions[skey].name, skey[0])
    out = [
        _view_of(
            tuple(layers),
            vkey[3],
            tensors[vkey][1],
            tensors[vkey][2],
            tensors[vkey][0],
            num_blocks,
            (head_major or {}).get(vkey[3], 0),
            int(block_sizes[vkey[3]]) if vkey[3] < len(block_sizes) else 0,
            heads_first,
        )
        for vkey, layers in views.items()
    ]
    for i, view in enumerate(out):
        state = (states or {}).get(view.group)
        if (
            state is not None
            and len(view.piece_offsets) == 1
            and view.piece_len >= state.page_bytes
        ):
            out[i] = replace(view, state=state)
    layout = CacheLayout(
        regions=tuple(regions.values()),
        views=tuple(out),
        block_sizes=tuple(int(b) for b in block_sizes),
        model=dict(model),
        tp_size=tp_size,
        tp_rank=tp_rank,
    )
    return layout, storages


def block_spans(
    local: CacheView,
    remote: CacheView,
    pairs: Sequence[tuple[int, int]] | np.ndarray,
    heads: HeadSlice | None = None,
) -> np.ndarray:
    """``(local offset, remote offset, length)`` rows moving block ``pairs[i] = (l, r)`` of the
    views' group; offsets are relative to each view's region. With ``heads``, only that slice
    of heads moves (from its place in the remote block to its place in the local one; both
    views head-major). Block ids or heads outside either view raise :class:`LayoutMismatch`
    (never a span into another block's memory)."""
    p = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    if p.size and (
        p.min() < 0 or p[:, 0].max() >= local.num_blocks or p[:, 1].max() >= remote.num_blocks
    ):
        raise LayoutMismatch(
            f"block ids out of range (local < {local.num_blocks}, remote < {remote.num_blocks})"
        )
    lo = local.offset + np.asarray(local.piece_offsets, dtype=np.int64)
    ro = remote.offset + np.asarray(remote.piece_offsets, dtype=np.int64)
    length = local.piece_len
    if heads is not None:
        if not (
            local.heads
            and remote.heads
            and local.head_len == remote.head_len
            and heads.count > 0
            and 0 <= heads.local_start <= local.heads - heads.count
            and 0 <= heads.remote_start <= remote.heads - heads.count
        ):
            raise LayoutMismatch(
                f"heads {heads} are not addressable in views of {local.heads} (local) and "
                f"{remote.heads} (remote) head-major heads"
            )
        lo = lo + heads.local_start * local.head_len
        ro = ro + heads.remote_start * remote.head_len
        length = heads.count * local.head_len
    out = np.empty((len(p) * len(lo), 3), dtype=np.int64)
    out[:, 0] = (p[:, 0:1] * local.block_stride + lo[None, :]).reshape(-1)
    out[:, 1] = (p[:, 1:2] * remote.block_stride + ro[None, :]).reshape(-1)
    out[:, 2] = length
    return out


def state_block_spans(
    local: CacheView,
    remote: CacheView,
    pairs: Sequence[tuple[int, int]] | np.ndarray,
    page_spans: Sequence[tuple[int, int, int]],
) -> np.ndarray:
    """``(local offset, remote offset, length)`` rows moving, for block ``pairs[i] = (l, r)``
    of two state views, the ``page_spans`` (offsets within one state page:
    :func:`~.parallel.state_page_spans`); offsets relative to each view's region. Spans or
    block ids outside either view raise :class:`LayoutMismatch`."""
    p = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    if p.size and (
        p.min() < 0 or p[:, 0].max() >= local.num_blocks or p[:, 1].max() >= remote.num_blocks
    ):
        raise LayoutMismatch(
            f"block ids out of range (local < {local.num_blocks}, remote < {remote.num_blocks})"
        )
    s = np.asarray(page_spans, dtype=np.int64).reshape(-1, 3)
    if len(local.piece_offsets) != 1 or len(remote.piece_offsets) != 1:
        raise LayoutMismatch("a state page is one piece per block")
    if s.size and (
        s[:, :2].min() < 0
        or s[:, 2].min() <= 0
        or (s[:, 0] + s[:, 2]).max() > local.piece_len
        or (s[:, 1] + s[:, 2]).max() > remote.piece_len
    ):
        raise LayoutMismatch(
            f"state spans outside pages of {local.piece_len} (local) and "
            f"{remote.piece_len} (remote) bytes"
        )
    lo = local.offset + local.piece_offsets[0] + s[:, 0]
    ro = remote.offset + remote.piece_offsets[0] + s[:, 1]
    out = np.empty((len(p) * len(s), 3), dtype=np.int64)
    out[:, 0] = (p[:, 0:1] * local.block_stride + lo[None, :]).reshape(-1)
    out[:, 1] = (p[:, 1:2] * remote.block_stride + ro[None, :]).reshape(-1)
    out[:, 2] = np.tile(s[:, 2], len(p))
    return out
