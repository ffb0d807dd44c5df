"""Grants: which peer may read or write which bytes of this process's registered regions.

A connector grants one peer access to the spans one transfer needs (the blocks it leased to
that peer, or offered to it for a push) and revokes the grant when the transfer ends. A backend
whose own code serves peers' requests (``tcp``) asks :meth:`GrantTable.allows` before it
serves one, once :meth:`~vllm_pd_ext.transport.base.Transport.enforce_grants` is on.

Each grant keeps, per region, its spans merged into sorted disjoint ``[start, end)`` extents,
so a check is one ``searchsorted`` over a request's spans per grant the peer holds on that
region: a span passes if it lies inside one extent of one of the peer's grants for that
operation (spans the client coalesced across adjacent granted blocks of one grant pass too).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_pd_ext.transport.errors import GrantError

#: ``(starts, ends)``: sorted, disjoint, non-adjacent byte extents of one region.
Extents = tuple[np.ndarray, np.ndarray]


def merge_extents(spans: Any, size: int) -> Extents:
    """Merge ``(offset, length)`` pairs inside a region of ``size`` bytes into extents.

    :class:`GrantError` if a span is empty or leaves the region (checked in a way int64 values
    cannot wrap)."""
    arr = np.asarray(spans, dtype=np.int64)
    if arr.size == 0:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise GrantError(f"grant spans must be (offset, length) pairs, got shape {arr.shape}")
    offs, lens = arr[:, 0], arr[:, 1]
    if (lens <= 0).any() or (lens > size).any() or (offs < 0).any() or (offs > size - lens).any():
        raise GrantError(f"a granted span leaves the region of {size} bytes")
    order = np.argsort(offs, kind="stable")
    starts, ends = offs[order], offs[order] + lens[order]
    reach = np.maximum.accumulate(ends)
    first = np.empty(len(starts), dtype=bool)
    first[0] = True
    first[1:] = starts[1:] > reach[:-1]  # a gap before it: a new extent starts here
    heads = np.flatnonzero(first)
    tails = np.append(heads[1:] - 1, len(starts) - 1)
    return starts[heads].copy(), reach[tails].copy()


def _inside(extents: Extents, offs: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Which ``[offs, ends)`` lie wholly inside one extent."""
    starts, stops = extents
    if len(starts) == 0:
        return np.zeros(len(offs), dtype=bool)
    i = np.searchsorted(starts, offs, side="right") - 1
    return (i >= 0) & (ends <= stops[np.maximum(i, 0)])


@dataclass(frozen=True)
class _Grant:
    op: str
    peer: str
    extents: Mapping[str, Extents]  # region name -> extents


class GrantTable:
    """Grants by id, indexed by ``(peer, op, region)``. Thread-safe: connectors grant and
    revoke from their threads while the data server's threads check."""

    def __init__(self, max_grants: int) -> None:
        self.max_grants = max_grants
        self._lock = threading.Lock()
        self._grants: dict[str, _Grant] = {}
        self._index: dict[tuple[str, str, str], dict[str, Extents]] = {}

    def add(self, grant_id: str, op: str, peer: str, extents: Mapping[str, Extents]) -> None:
        """Record (or replace) grant ``grant_id``; :class:`GrantError` when the table is full."""
        grant = _Grant(op, peer, {r: e for r, e in extents.items() if len(e[0])})
        with self._lock:
            self._drop(grant_id)
            if len(self._grants) >= self.max_grants:
                raise GrantError(f"{self.max_grants} grants are held already; {grant_id!r} refused")
            self._grants[grant_id] = grant
            for region, ext in grant.extents.items():
                self._index.setdefault((peer, op, region), {})[grant_id] = ext

    def remove(self, grant_id: str) -> bool:
        """Drop grant ``grant_id``; False if there was none."""
        with self._lock:
            return self._drop(grant_id)

    def _drop(self, grant_id: str) -> bool:
        grant = self._grants.pop(grant_id, None)
        if grant is None:
            return False
        for region in grant.extents:
            key = (grant.peer, grant.op, region)
            held = self._index.get(key)
            if held is not None:
                held.pop(grant_id, None)
                if not held:
                    del self._index[key]
        return True

    def allows(self, peer: str, op: str, region: str, pairs: np.ndarray) -> bool:
        """Whether every ``(offset, length)`` row of ``pairs`` (already checked against the
        region's bounds) lies inside what ``peer`` was granted for ``op`` on ``region``."""
        with self._lock:
            held = list(self._index.get((peer, op, region), {}).values())
        if len(pairs) == 0:
            return True
        offs = pairs[:, 0]
        ends = offs + pairs[:, 1]
        for extents in reversed(held):  # the newest grant is the likeliest
            left = ~_inside(extents, offs, ends)
            if not left.any():
                return True
            offs, ends = offs[left], ends[left]
        return False

    def clear(self) -> None:
        with self._lock:
            self._grants.clear()
            self._index.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._grants)

    def __contains__(self, grant_id: object) -> bool:
        with self._lock:
            return grant_id in self._grants
