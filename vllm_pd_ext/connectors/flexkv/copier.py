"""Block copies between vLLM's KV cache and the CPU tier (torch and numpy only, no vLLM).

:class:`BlockCopier` owns the CPU tier's memory (one ``[slots, block_bytes]`` byte tensor,
pinned when CUDA is available) and copies whole blocks between it (or any CPU row tensor) and
the cache through :func:`~vllm_pd_ext.connectors.flexkv.blocks.block_views`:

* on a CPU cache every run of blocks that is consecutive on both sides is one strided
  ``copy_`` per view (no temporaries: fresh memory's first-touch page faults cost more than
  the copy); scattered blocks go view by view through ``index_select`` / ``index_copy_``;
  :meth:`BlockCopier.pieces` exposes a block's pieces as byte arrays where they live, so
  block files are read straight into the cache;
* on a CUDA cache the copies run on a dedicated side stream that first waits for the compute
  stream (``after``, an event recorded when the step handed the blocks over): a save gathers
  the blocks into a device staging buffer and copies it to the pinned rows in one transfer
  per run of consecutive rows; a load copies pinned rows to a device staging buffer the same
  way and scatters it into the blocks. Gathers and scatters on the device are one
  ``index_select`` / ``index_copy_`` per cache storage when every piece has the same length
  and lies on a multiple of it (vLLM's FlashAttention layout: all K and V pieces of a block in
  one kernel), else one per piece. Every call returns only after its stream work is done
  (``synchronize``), so the caller may reuse or report the blocks and rows at once.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vllm_pd_ext.connectors.flexkv.blocks import BlockViews

#: Bytes per round of a staged copy (scattered CPU blocks, CUDA transfers); buffers are
#: allocated once per thread and reused.
STAGE_BYTES = 16 << 20


def runs(*seqs: Sequence[int]) -> list[tuple[int, int]]:
    """``[a, b)`` index ranges over which every sequence in ``seqs`` steps by +1."""
    n = len(seqs[0])
    out: list[tuple[int, int]] = []
    a = 0
    for j in range(1, n + 1):
        if j == n or any(s[j] != s[j - 1] + 1 for s in seqs):
            out.append((a, j))
            a = j
    return out


@dataclass(frozen=True)
class _FlatGroup:
    """The pieces that lie in one storage, seen as rows of ``L`` bytes: piece ``i`` of block
    ``b`` is row ``starts[i] + b * strides[i]`` of ``rows`` and row ``cols[i]`` of a tier row
    seen as ``[block_bytes // L, L]``."""

    rows: torch.Tensor
    starts: torch.Tensor
    strides: torch.Tensor
    cols: torch.Tensor


def _flat_groups(views, block_bytes: int) -> list[_FlatGroup] | None:
    """Every piece as a row of one ``[storage bytes // L, L]`` view per storage, when all
    pieces have one length ``L`` that divides their offsets, block strides and the tier row;
    else None."""
    length = views[0].length
    if any(v.length != length for v in views) or block_bytes % length:
        return None
    by_storage: dict[int, list] = {}
    for v in views:
        es = v.view.element_size()
        start, stride = v.view.storage_offset() * es, v.view.stride(0) * es
        if start % length or stride % length:
            return None
        storage = v.view.untyped_storage()
        by_storage.setdefault(storage.data_ptr(), [storage, []])[1].append(
            (start // length, stride // length, v.column // length)
        )
    groups = []
    dev = views[0].view.device
    for storage, pieces in by_storage.values():
        flat = torch.empty(0, dtype=torch.uint8, device=dev).set_(storage)
        rows = flat[: flat.numel() // length * length].view(-1, length)
        s, st, c = (
            torch.tensor(x, dtype=torch.long, device=dev) for x in zip(*pieces, strict=True)
        )
        groups.append(_FlatGroup(rows, s, st, c))
    return groups


class BlockCopier:
    """The CPU tier's rows and block copies for one worker's KV cache."""

    def __init__(self, views: BlockViews, cpu_slots: int, pool: torch.Tensor | None = None) -> None:
        """``pool``: the CPU tier to use (rows at least ``views.block_bytes`` wide, shared by
        the copiers of a hybrid model's KV cache groups); a new one of ``cpu_slots`` rows
        when None. A block's bytes are the first ``block_bytes`` of its row."""
        self.views = list(views.views)
        self.block_bytes = views.block_bytes
        self.device = self.views[0].view.device
        self.cuda = self.device.type == "cuda"
        self.pinned = torch.cuda.is_available()
        self.pool = (
            pool
            if pool is not None
            else torch.empty(
                (cpu_slots, self.block_bytes), dtype=torch.uint8, pin_memory=self.pinned
            )
        )
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        # [num_blocks, piece bytes] byte arrays over the cache (CPU caches only)
        self._np = None if self.cuda else [v.view.numpy().view(np.uint8) for v in self.views]
        self._stages: dict[tuple[int, str], torch.Tensor] = {}
        try:
            self._flat = _flat_groups(self.views, self.block_bytes)
        except (RuntimeError, ValueError):  # an unusual storage: copy piece by piece
            self._flat = None

    # ---- helpers ----
    def compute_event(self) -> torch.cuda.Event | None:
        """An event on the current (compute) stream: copies issued later wait for it.
        None on CPU. Call it on the thread that runs the forward pass."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    @property
    def in_place(self) -> bool:
        """True when block files can be read straight into the cache (:meth:`pieces`)."""
        return self._np is not None

    def empty_rows(self, n: int) -> torch.Tensor:
        """A new ``[n, block_bytes]`` CPU byte tensor (pinned where CUDA exists)."""
        return torch.empty((n, self.block_bytes), dtype=torch.uint8, pin_memory=self.pinned)

    def pieces(self, block_id: int) -> list[np.ndarray] | None:
        """Block ``block_id``'s pieces as writable byte arrays in the cache, in row order;
        None when the cache is not in CPU memory."""
        if self._np is None:
            return None
        return [a[block_id] for a in self._np]

    def _stage(self, nbytes: int, device: torch.device, pin: bool = False) -> torch.Tensor:
        key = (threading.get_ident(), str(device))
        buf = self._stages.get(key)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device, pin_memory=pin)
            self._stages[key] = buf
        return buf[:nbytes]

    def _chunk(self) -> int:
        return max(1, STAGE_BYTES // self.block_bytes)

    # ---- device -> CPU rows ----
    def gather(
        self,
        block_ids: Sequence[int],
        dst: torch.Tensor,
        rows: Sequence[int],
        after: torch.cuda.Event | None = None,
    ) -> None:
        """Copy cache block ``block_ids[j]`` into row ``rows[j]`` of ``dst`` (a CPU
        ``[m, block_bytes]`` byte tensor) for every ``j``."""
        if not block_ids:
            return
        if self.cuda:
            self._gather_cuda(block_ids, dst, rows, after)
            return
        spans = runs(block_ids, rows)
        if len(spans) * 4 <= max(len(block_ids), 4):
            for v in self.views:
                cols = dst[:, v.column : v.column + v.length].view(v.view.dtype)
                for a, b in spans:
                    r, blk = rows[a], block_ids[a]
                    cols[r : r + b - a].copy_(v.view[blk : blk + b - a])
            return
        src = torch.tensor(list(block_ids), dtype=torch.long)
        dst_idx = torch.tensor(list(rows), dtype=torch.long)
        for v in self.views:
            cols = dst[:, v.column : v.column + v.length].view(v.view.dtype)
            cols.index_copy_(0, dst_idx, v.view.index_select(0, src))

    def _device_gather(self, ids: torch.Tensor, stage: torch.Tensor) -> None:
        """Fill ``stage[j]`` (``[n, block_bytes]`` on the cache's device) with block
        ``ids[j]``; ``ids`` is a long tensor on that device."""
        n = len(ids)
        if self._flat is None:
            for v in self.views:
                cols = stage[:, v.column : v.column + v.length].view(v.view.dtype)
                cols.copy_(v.view.index_select(0, ids))
            return
        per_row = self.block_bytes // self._flat[0].rows.shape[1]
        out = stage.view(n * per_row, -1)
        for g in self._flat:
            src = (g.starts[None, :] + ids[:, None] * g.strides[None, :]).reshape(-1)
            if len(self._flat) == 1 and len(g.cols) == per_row:  # every piece, in order
                torch.index_select(g.rows, 0, src, out=out)
            else:
                dst = g.cols[None, :] + per_row * torch.arange(n, device=ids.device)[:, None]
                out.index_copy_(0, dst.reshape(-1), g.rows.index_select(0, src))

    def _device_scatter(self, ids: torch.Tensor, stage: torch.Tensor) -> None:
        """Copy ``stage[j]`` (``[n, block_bytes]`` on the cache's device) into block
        ``ids[j]``; ``ids`` is a long tensor on that device."""
        n = len(ids)
        if self._flat is None:
            for v in self.views:
                v.view.index_copy_(
                    0, ids, stage[:, v.column : v.column + v.length].view(v.view.dtype)
                )
            return
        per_row = self.block_bytes // self._flat[0].rows.shape[1]
        src_rows = stage.view(n * per_row, -1)
        for g in self._flat:
            dst = (g.starts[None, :] + ids[:, None] * g.strides[None, :]).reshape(-1)
            if len(self._flat) == 1 and len(g.cols) == per_row:
                g.rows.index_copy_(0, dst, src_rows)
            else:
                src = g.cols[None, :] + per_row * torch.arange(n, device=ids.device)[:, None]
                g.rows.index_copy_(0, dst, src_rows.index_select(0, src.reshape(-1)))

    def _gather_cuda(self, block_ids, dst, rows, after) -> None:
        per = self._chunk()
        stage = self._stage(per * self.block_bytes, self.device).view(per, self.block_bytes)
        assert self.stream is not None  # a CUDA cache has its side stream
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            for at in range(0, len(block_ids), per):
                ids, rws = block_ids[at : at + per], rows[at : at + per]
                n = len(ids)
                idx = torch.tensor(list(ids), dtype=torch.long).to(self.device, non_blocking=True)
                self._device_gather(idx, stage[:n])
                for a, b in runs(rws):
                    dst[rws[a] : rws[a] + b - a, : self.block_bytes].copy_(
                        stage[a:b], non_blocking=True
                    )
                # the staging buffer is reused by the next round: its copies must end first
                self.stream.synchronize()

    # ---- CPU rows -> device ----
    def scatter(
        self,
        block_ids: Sequence[int],
        src: torch.Tensor,
        picks: Sequence[int],
        after: torch.cuda.Event | None = None,
    ) -> None:
        """Copy row ``picks[j]`` of ``src`` (a CPU ``[m, block_bytes]`` byte tensor) into
        cache block ``block_ids[j]`` for every ``j``."""
        if not block_ids:
            return
        if self.cuda:
            self._scatter_cuda(block_ids, src, picks, after)
            return
        spans = runs(block_ids, picks)
        if len(spans) * 4 <= max(len(block_ids), 4):
            for v in self.views:
                cols = src[:, v.column : v.column + v.length].view(v.view.dtype)
                for a, b in spans:
                    p, blk = picks[a], block_ids[a]
                    v.view[blk : blk + b - a].copy_(cols[p : p + b - a])
            return
        # scattered: view by view through a small reused buffer (index_select then index_copy_)
        dst = torch.tensor(list(block_ids), dtype=torch.long)
        idx = torch.tensor(list(picks), dtype=torch.long)
        for v in self.views:
            cols = src[:, v.column : v.column + v.length].view(v.view.dtype)
            step = max(1, STAGE_BYTES // v.length)
            stage = self._stage(min(step, len(picks)) * v.length, self.device)
            for a in range(0, len(block_ids), step):
                n = len(picks[a : a + step])
                tmp = stage[: n * v.length].view(v.view.dtype).view(n, -1)
                torch.index_select(cols, 0, idx[a : a + step], out=tmp)
                v.view.index_copy_(0, dst[a : a + step], tmp)

    def _scatter_cuda(self, block_ids, src, picks, after) -> None:
        per = self._chunk()
        stage = self._stage(per * self.block_bytes, self.device).view(per, self.block_bytes)
        assert self.stream is not None  # a CUDA cache has its side stream
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            for at in range(0, len(block_ids), per):
                ids, pks = block_ids[at : at + per], picks[at : at + per]
                n = len(ids)
                for a, b in runs(pks):
                    stage[a:b].copy_(
                        src[pks[a] : pks[a] + b - a, : self.block_bytes], non_blocking=True
                    )
                idx = torch.tensor(list(ids), dtype=torch.long).to(self.device, non_blocking=True)
                self._device_scatter(idx, stage[:n])
                self.stream.synchronize()
