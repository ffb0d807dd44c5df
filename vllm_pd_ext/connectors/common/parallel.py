"""Which tensor-parallel pairings our P/D connectors serve, and which heads move where.

Each engine's rank ``r`` of ``n`` holds KV heads ``[r * H / n, (r + 1) * H / n)`` of the model's
``H`` KV heads (vLLM's split); each rank's side channel is at ``side_channel_port + r``.

* **Same TP size**: decode rank ``r`` pairs with prefill rank ``r`` and moves whole blocks
  (READ and WRITE; also for caches that are not split by heads, as MLA's or Mamba state).
* **Different TP sizes, READ**: decode rank ``q`` reads, from every prefill rank whose heads
  overlap its own, the overlapping heads, into their place in its own blocks
  (:func:`head_slices`): one source rank when decode has more ranks (a slice of that rank's
  heads), several when prefill has more (each one's whole heads into a slice of the local
  block). A prefill rank frees a request's blocks once every decode rank that reads it
  (:func:`reader_ranks`) said done. This needs every cache's blocks to hold each head's bytes
  contiguously (vLLM's head-major layout, the CPU backend's ``[blocks, heads, block_size, ...]``);
  the worker refuses other layouts at handshake (``layout.py``).
* **Different TP sizes, WRITE**: the same head slices the other way: each prefill rank writes,
  into every decode rank whose heads overlap its own (:func:`reader_ranks`), those heads in
  their place in the decode blocks the rank offered; each decode rank waits for the "written"
  notice of every prefill rank that holds heads of its own (:func:`source_ranks`).
* Refused (:func:`tp_refusal`): sizes that do not split the model's KV heads evenly (more
  ranks than KV heads included: those ranks replicate heads), and models with SSM state.

The supported matrix is in the connectors' README.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_pd_ext.transfer_params import READ, WRITE

#: The transfer modes that move head slices between engines of different TP sizes.
MODES = (READ, WRITE)


@dataclass(frozen=True)
class HeadSlice:
    """Heads ``[remote_start, remote_start + count)`` of prefill rank ``remote_rank`` are
    heads ``[local_start, local_start + count)`` of the local rank (indices within each rank's
    own heads)."""

    remote_rank: int
    remote_start: int
    local_start: int
    count: int


def tp_refusal(
    prefill_tp: object,
    decode_tp: object,
    *,
    mode: str = READ,
    kv_heads: int | None = None,
    state: bool = False,
) -> str | None:
    """Why a prefill engine of TP size ``prefill_tp`` and a decode engine of ``decode_tp``
    cannot exchange KV in ``mode`` for a model of ``kv_heads`` KV heads (None: not known
    here, the sizes alone are checked) that keeps per-request ``state`` (SSM pages, not
    split like KV heads), or None when they can."""
    if prefill_tp == decode_tp:
        return None
    sizes = f"prefill TP {prefill_tp}, decode TP {decode_tp}"
    if not isinstance(prefill_tp, int) or not isinstance(decode_tp, int):
        return f"tensor parallel sizes differ ({sizes}) and one is not a number"
    if prefill_tp < 1 or decode_tp < 1:
        return f"tensor parallel sizes differ ({sizes}) and one is below 1"
    if mode not in MODES:
        return f"tensor parallel sizes differ ({sizes}) and {mode!r} is no transfer mode"
    if state:
        return (
            f"tensor parallel sizes differ ({sizes}) and the model keeps SSM state, which "
            "moves only between engines with the same --tensor-parallel-size"
        )
    if kv_heads is not None:
        for side, n in (("prefill", prefill_tp), ("decode", decode_tp)):
            if n > kv_heads:
                return (
                    f"tensor parallel sizes differ ({sizes}) and {side} TP {n} is more than "
                    f"the model's {kv_heads} KV heads (its ranks replicate heads): use the "
                    "same --tensor-parallel-size on both sides"
                )
            if kv_heads % n:
                return (
                    f"tensor parallel sizes differ ({sizes}) and {side} TP {n} does not "
                    f"divide the model's {kv_heads} KV heads"
                )
    return None


def _overlap(a: int, a_tp: int, b: int, b_tp: int) -> bool:
    """Whether rank ``a`` of ``a_tp`` and rank ``b`` of ``b_tp`` hold a common head (any
    number of heads both sizes divide)."""
    return a * b_tp < (b + 1) * a_tp and b * a_tp < (a + 1) * b_tp


def source_ranks(rank: int, tp_size: int, remote_tp: int) -> list[int]:
    """The prefill ranks (of ``remote_tp``) decode rank ``rank`` (of ``tp_size``) reads."""
    return [r for r in range(remote_tp) if _overlap(rank, tp_size, r, remote_tp)]


def reader_ranks(rank: int, tp_size: int, decode_tp: int) -> list[int]:
    """The decode ranks (of ``decode_tp``) that read prefill rank ``rank`` (of ``tp_size``)."""
    return [q for q in range(decode_tp) if _overlap(q, decode_tp, rank, tp_size)]


def head_slices(rank: int, tp_size: int, remote_tp: int, kv_heads: int) -> list[HeadSlice]:
    """What decode rank ``rank`` of ``tp_size`` reads from each prefill rank of ``remote_tp``
    for a cache of ``kv_heads`` heads in all; ``ValueError`` when a size does not divide it."""
    if refusal := tp_refusal(remote_tp, tp_size, kv_heads=kv_heads):
        raise ValueError(refusal)
    mine, theirs = kv_heads // tp_size, kv_heads // remote_tp
    lo, hi = rank * mine, (rank + 1) * mine
    out = []
    for r in source_ranks(rank, tp_size, remote_tp):
        start, stop = max(lo, r * theirs), min(hi, (r + 1) * theirs)
        out.append(HeadSlice(r, start - r * theirs, start - lo, stop - start))
    return out


def rank_refusal(ours: int, theirs: object, expected: int | None = None) -> str | None:
    """Why a peer that says it is TP rank ``theirs`` cannot be the rank ``expected`` (by
    default ``ours``, the same rank) that our rank ``ours`` meant to reach (a side-channel
    port of another engine's rank answered), or None when it can."""
    want = ours if expected is None else expected
    if theirs == want:
        return None
    meant = "" if want == ours else f" (it meant to reach rank {want})"
    return (
        f"TP rank {ours} reached a peer that is TP rank {theirs}{meant}: each engine's "
        "side_channel_port needs its TP size in consecutive free ports"
    )


def total_kv_heads(vllm_config: Any) -> int | None:
    """The model's KV heads across all ranks (None when the config cannot say)."""
    try:
        return int(vllm_config.model_config.get_total_num_kv_heads())
    except (AttributeError, TypeError, ValueError):
        return None
