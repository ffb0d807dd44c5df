"""Span arrays: the (local offset, remote offset, length) triples a batched transfer moves.

Spans are kept as an ``int64`` numpy array of shape ``(n, 3)`` so that validating and coalescing
hundreds of thousands of them (a 32k-token prompt over 28 layers) stays vectorised.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from vllm_pd_ext.transport.errors import RegionBoundsError

#: Column indices of a span array.
LOCAL, REMOTE, LENGTH = 0, 1, 2


def as_span_array(spans: Any) -> np.ndarray:
    """Return ``spans`` as a C-contiguous ``int64`` array of shape ``(n, 3)``.

    Accepts an ``(n, 3)`` integer array or any iterable of ``(local, remote, length)`` triples.
    Raises :class:`RegionBoundsError` for any other shape.
    """
    if isinstance(spans, np.ndarray):
        arr = spans
    else:
        items = spans if isinstance(spans, list | tuple) else list(_as_iterable(spans))
        arr = np.asarray(items, dtype=np.int64) if items else np.empty((0, 3), np.int64)
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise RegionBoundsError(f"spans must have shape (n, 3), got {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise RegionBoundsError(f"spans must be integers, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _as_iterable(spans: Any) -> Iterable:
    try:
        return iter(spans)
    except TypeError as e:
        raise RegionBoundsError(f"spans must be an (n, 3) array or triples: {e}") from e


def check_bounds(
    spans: np.ndarray, local_size: int, remote_size: int, *, target: int | None = None
) -> None:
    """Refuse spans that are empty, negative or outside ``[0, size)`` of their region.

    ``target`` (``LOCAL`` or ``REMOTE``) names the side that is written; spans overlapping
    there are refused too, since their result would depend on the engine's ordering.
    Raises :class:`RegionBoundsError` naming the first bad span. Pure: touches no memory.
    """
    if len(spans) == 0:
        return
    local, remote, length = spans[:, LOCAL], spans[:, REMOTE], spans[:, LENGTH]
    bad = (length <= 0) | (local < 0) | (remote < 0)
    # start > size - length, not start + length > size: a sum of int64s can wrap
    bad |= (length > local_size) | (local > local_size - length)
    bad |= (length > remote_size) | (remote > remote_size - length)
    if bad.any():
        i = int(np.argmax(bad))
        lo, ro, n = (int(x) for x in spans[i])
        raise RegionBoundsError(
            f"span {i} (local={lo}, remote={ro}, length={n}) is outside the registered "
            f"regions (local size {local_size}, remote size {remote_size})"
        )
    if target is not None and len(spans) > 1:
        starts = spans[:, target]
        order = np.argsort(starts, kind="stable")
        s, lengths = starts[order], length[order]
        overlap = s[1:] < s[:-1] + lengths[:-1]
        if overlap.any():
            j = int(np.argmax(overlap))
            side = "local" if target == LOCAL else "remote"
            raise RegionBoundsError(
                f"spans {int(order[j])} and {int(order[j + 1])} overlap in the {side} "
                f"(destination) region at offset {int(s[j + 1])}"
            )


def coalesce(spans: np.ndarray) -> np.ndarray:
    """Merge runs of spans that are adjacent on both sides into single spans.

    Span ``i+1`` joins span ``i`` when it starts where ``i`` ends in the local and in the
    remote region. Order is kept; the bytes moved are the same. Returns a new array.
    """
    if len(spans) < 2:
        return spans.copy()
    ends_local = spans[:-1, LOCAL] + spans[:-1, LENGTH]
    ends_remote = spans[:-1, REMOTE] + spans[:-1, LENGTH]
    joins = (spans[1:, LOCAL] == ends_local) & (spans[1:, REMOTE] == ends_remote)
    if not joins.any():
        return spans.copy()
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    out = spans[starts].copy()
    out[:, LENGTH] = np.add.reduceat(spans[:, LENGTH], starts)
    return out


def total_bytes(spans: np.ndarray) -> int:
    """Sum of span lengths."""
    return int(spans[:, LENGTH].sum()) if len(spans) else 0


def split_long(spans: np.ndarray, max_length: int) -> np.ndarray:
    """Cut spans longer than ``max_length`` into consecutive pieces of at most that length.

    Some engines move many medium entries in parallel but one huge entry serially; this lets
    a backend choose its entry size after coalescing. Order and bytes are unchanged.
    """
    if max_length <= 0:
        raise ValueError("max_length must be positive")
    lengths = spans[:, LENGTH]
    pieces = -(-lengths // max_length)
    if len(spans) == 0 or int(pieces.max()) == 1:
        return spans.copy()
    row = np.repeat(np.arange(len(spans)), pieces)
    first = np.concatenate(([0], np.cumsum(pieces)[:-1]))
    k = np.arange(len(row)) - np.repeat(first, pieces)  # piece index within its span
    out = np.empty((len(row), 3), dtype=np.int64)
    out[:, LOCAL] = spans[row, LOCAL] + k * max_length
    out[:, REMOTE] = spans[row, REMOTE] + k * max_length
    out[:, LENGTH] = np.minimum(max_length, lengths[row] - k * max_length)
    return out
