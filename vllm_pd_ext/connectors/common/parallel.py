"""Which tensor-parallel pairings our P/D connectors serve, decided in one place.

Rank ``r`` of a decode engine pairs with rank ``r`` of the prefill engine: it handshakes with
the prefill's side channel at ``side_channel_port + r`` and moves blocks only with that rank's
transport. That is right when both engines have the same tensor parallel size, because then
rank ``r`` holds the same KV heads on both sides. Engines whose sizes differ split the heads
differently; moving head slices between them is not implemented, so such a pair is refused:
the decode side computes the prompt itself (vLLM's ``kv_load_failure_policy`` decides for a
load already under way).

The supported matrix is in the connectors' README.
"""

from __future__ import annotations


def tp_refusal(prefill_tp: object, decode_tp: object) -> str | None:
    """Why a prefill engine of TP size ``prefill_tp`` and a decode engine of ``decode_tp``
    cannot exchange KV, or None when they can."""
    if prefill_tp == decode_tp:
        return None
    return (
        f"tensor parallel sizes differ (prefill TP {prefill_tp}, decode TP {decode_tp}): "
        "KV moves only between engines with the same --tensor-parallel-size"
    )


def rank_refusal(ours: int, theirs: object) -> str | None:
    """Why a peer that says it is TP rank ``theirs`` cannot pair with our rank ``ours`` (a
    side-channel port of another engine's rank answered), or None when it can."""
    if theirs == ours:
        return None
    return (
        f"TP rank {ours} reached a peer that is TP rank {theirs}: each engine's "
        "side_channel_port needs its TP size in consecutive free ports"
    )
