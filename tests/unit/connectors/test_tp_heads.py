"""Which heads a decode rank reads from which prefill rank when the TP sizes differ, the byte
spans that moves inside each block, which combinations are refused, and leases with several
readers (``parallel.py``, ``layout.py``, ``leases.py``): pure functions over CPU tensors."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_pd_ext.connectors.common.layout import (
    LayoutMismatch,
    block_spans,
    layout_from_caches,
)
from vllm_pd_ext.connectors.common.leases import LeaseTable
from vllm_pd_ext.connectors.common.parallel import (
    HeadSlice,
    head_slices,
    reader_ranks,
    source_ranks,
    tp_refusal,
)
from vllm_pd_ext.connectors.common.shell import declared_heads_first
from vllm_pd_ext.transfer_params import READ, WRITE

BLOCK, HEAD, NUM_BLOCKS = 16, 8, 6


def test_a_decode_rank_of_a_smaller_tp_reads_every_overlapping_prefill_ranks_whole_heads():
    # P TP 2 -> D TP 1, 4 heads: each prefill rank's 2 heads go to their place in the block
    assert head_slices(0, 1, 2, 4) == [HeadSlice(0, 0, 0, 2), HeadSlice(1, 0, 2, 2)]
    # P TP 4 -> D TP 2, 8 heads: decode rank 1 holds heads 4..7, prefill ranks 2 and 3's
    assert head_slices(1, 2, 4, 8) == [HeadSlice(2, 0, 0, 2), HeadSlice(3, 0, 2, 2)]


def test_a_decode_rank_of_a_larger_tp_reads_a_slice_of_one_prefill_ranks_heads():
    # P TP 1 -> D TP 2, 4 heads: rank 0 reads heads 0..1, rank 1 heads 2..3, of prefill rank 0
    assert head_slices(0, 2, 1, 4) == [HeadSlice(0, 0, 0, 2)]
    assert head_slices(1, 2, 1, 4) == [HeadSlice(0, 2, 0, 2)]
    # P TP 2 -> D TP 4, 8 heads: decode rank 3 holds heads 6..7, the second half of rank 1's
    assert head_slices(3, 4, 2, 8) == [HeadSlice(1, 2, 0, 2)]


def test_sizes_that_are_not_multiples_split_at_head_boundaries():
    # P TP 3 -> D TP 2, 6 heads: decode rank 0 holds heads 0..2 (rank 0's two, rank 1's first)
    assert head_slices(0, 2, 3, 6) == [HeadSlice(0, 0, 0, 2), HeadSlice(1, 0, 2, 1)]
    assert head_slices(1, 2, 3, 6) == [HeadSlice(1, 1, 0, 1), HeadSlice(2, 0, 1, 2)]


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "heads"),
    [(1, 2, 4), (2, 1, 4), (4, 1, 8), (1, 4, 4), (3, 2, 6), (2, 3, 6), (2, 2, 4), (4, 8, 8)],
)
def test_every_decode_head_comes_from_exactly_the_prefill_rank_that_holds_it(
    prefill_tp, decode_tp, heads
):
    """Across all decode ranks: each global head once, from its prefill rank and place, and
    a prefill rank's readers are exactly the decode ranks that read from it."""
    per_p, per_d = heads // prefill_tp, heads // decode_tp
    seen = []
    for q in range(decode_tp):
        slices = head_slices(q, decode_tp, prefill_tp, heads)
        assert [s.remote_rank for s in slices] == source_ranks(q, decode_tp, prefill_tp)
        for s in slices:
            for i in range(s.count):
                local, remote = q * per_d + s.local_start + i, s.remote_rank * per_p
                assert local == remote + s.remote_start + i
                seen.append(local)
            assert q in reader_ranks(s.remote_rank, prefill_tp, decode_tp)
    assert sorted(seen) == list(range(heads))
    for r in range(prefill_tp):
        for q in reader_ranks(r, prefill_tp, decode_tp):
            assert r in source_ranks(q, decode_tp, prefill_tp)


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "mode", "heads", "refusal"),
    [
        (2, 2, WRITE, 1, None),  # same sizes: whole blocks, replicated heads included
        (2, 1, READ, 4, None),
        (1, 2, READ, 2, None),
        (3, 2, READ, 6, None),
        (2, 1, READ, None, None),  # heads not known here: the worker's layout check decides
        (2, 1, WRITE, 4, None),  # each prefill rank writes its heads into their place
        (1, 2, WRITE, 4, None),
        (1, 4, WRITE, 2, "decode TP 4 is more than the model's 2 KV heads"),
        (2, 1, "push", 4, "'push' is no transfer mode"),
        (2, 1, READ, 1, "prefill TP 2 is more than the model's 1 KV heads"),
        (1, 4, READ, 2, "decode TP 4 is more than the model's 2 KV heads"),
        (4, 2, READ, 6, "prefill TP 4 does not divide the model's 6 KV heads"),
        (2, 3, READ, 4, "decode TP 3 does not divide the model's 4 KV heads"),
        (2, 0, READ, 4, "one is below 1"),
        ("2", 1, READ, 4, "one is not a number"),
    ],
)
def test_the_supported_tp_matrix(prefill_tp, decode_tp, mode, heads, refusal):
    got = tp_refusal(prefill_tp, decode_tp, mode=mode, kv_heads=heads)
    if refusal is None:
        assert got is None
    else:
        assert got is not None and refusal in got
        assert f"prefill TP {prefill_tp}, decode TP {decode_tp}" in got


def test_a_model_with_state_pages_needs_equal_tp_sizes():
    assert tp_refusal(2, 2, kv_heads=4, state=True) is None
    got = tp_refusal(2, 1, kv_heads=4, state=True)
    assert got is not None and "SSM state" in got


def test_head_slices_refuse_what_the_matrix_refuses():
    with pytest.raises(ValueError, match="does not divide the model's 6 KV heads"):
        head_slices(0, 4, 2, 6)


def cpu_cache(heads: int, fill: bool, shape: str = "cpu") -> dict[str, torch.Tensor]:
    """Two layers shaped like vLLM's CPU backend ``[blocks, heads, block_size, 2 * head]``
    (or K/V first, token-major: ``[2, blocks, block_size, heads, head]``)."""
    g = torch.Generator().manual_seed(heads)
    dims = (
        (NUM_BLOCKS, heads, BLOCK, 2 * HEAD)
        if shape == "cpu"
        else (2, NUM_BLOCKS, BLOCK, heads, HEAD)
    )
    return {
        f"layers.{i}.attn": torch.randn(dims, generator=g) if fill else torch.zeros(dims)
        for i in range(2)
    }


def layout_of(cache, heads, tp_size, tp_rank=0):
    return layout_from_caches(
        cache,
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK,
        model={"layers": 2, "tp_size": tp_size},
        head_major={0: heads},
        tp_size=tp_size,
        tp_rank=tp_rank,
    )


def copy_spans(dst: torch.Tensor, src: torch.Tensor, spans: np.ndarray) -> None:
    for lo, ro, n in spans:
        dst[lo : lo + n] = src[ro : ro + n]


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2), (4, 2), (2, 4)])
def test_head_spans_move_each_prefill_ranks_heads_into_their_place(prefill_tp, decode_tp):
    """Real cache tensors on both sides, bytes copied along the spans: every decode rank's
    blocks end up equal to the model's heads it holds, taken from the prefill ranks' blocks
    (one pair of blocks, ids differing on the two sides)."""
    heads = 8
    per_p, per_d = heads // prefill_tp, heads // decode_tp
    prefill = [cpu_cache(per_p, True) for _ in range(prefill_tp)]
    p_layouts = [layout_of(c, per_p, prefill_tp, r) for r, c in enumerate(prefill)]
    for q in range(decode_tp):
        cache = cpu_cache(per_d, False)
        mine, local_bytes = layout_of(cache, per_d, decode_tp, q)
        for p_layout, _ in p_layouts:
            mine.check_compatible(p_layout)  # different TP sizes, head-major: compatible
        for s in head_slices(q, decode_tp, prefill_tp, heads):
            theirs, remote_bytes = p_layouts[s.remote_rank]
            for a, b in zip(mine.views, theirs.views, strict=True):
                spans = block_spans(a, b, [(4, 1)], s)
                assert len(spans) == 1 and spans[0, 2] == s.count * BLOCK * 2 * HEAD * 4
                copy_spans(local_bytes[a.region], remote_bytes[b.region], spans)
        for name, t in cache.items():
            want = torch.cat([prefill[r][name][1] for r in range(prefill_tp)])
            assert torch.equal(t[4], want[q * per_d : (q + 1) * per_d]), (q, name)
            assert torch.count_nonzero(t[1]) == 0  # no other block written


def test_a_token_major_layout_is_refused_between_tp_sizes():
    """K/V first and heads inside each token (``[2, blocks, block_size, heads, head]``): a
    slice of heads is not one span per block, so engines of different TP sizes refuse at
    handshake, naming the layout; of the same size they still match."""
    p, _ = layout_of(cpu_cache(2, True, "kv-first"), 2, 2)
    d, _ = layout_of(cpu_cache(4, False, "kv-first"), 4, 1)
    assert not any(v.heads for v in p.views + d.views)
    with pytest.raises(LayoutMismatch, match="is not head-major"):
        d.check_compatible(p)
    same, _ = layout_of(cpu_cache(2, False, "kv-first"), 2, 2)
    same.check_compatible(p)
    with pytest.raises(LayoutMismatch, match="not addressable"):
        block_spans(d.views[0], p.views[0], [(1, 1)], HeadSlice(0, 0, 0, 2))


@pytest.mark.parametrize("heads_first", [False, True], ids=["shape only", "declared"])
def test_as_many_heads_as_tokens_per_block_is_head_major_only_when_declared(heads_first):
    """A block of 16 heads x 16 tokens: the shape is the same whether heads or tokens come
    first. Told nothing, the layout is not head-major (so engines of different TP sizes
    refuse it, never read the wrong bytes); told the engine's layout puts heads first, it is.
    With heads != tokens the shape decides alone."""
    heads = BLOCK
    cache = {"layers.0.attn": torch.zeros(NUM_BLOCKS, heads, BLOCK, 2 * HEAD)}  # either order
    layout, _ = layout_from_caches(
        cache,
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK,
        model={"layers": 1},
        head_major={0: heads},
        heads_first=heads_first,
    )
    assert layout.views[0].heads == (heads if heads_first else 0)
    assert layout.views[0].heads_axis == (0 if heads_first else -1)
    guessed, _ = layout_of(cpu_cache(4, False), 4, 1)  # 4 heads, 16 tokens: unambiguous
    assert guessed.views[0].heads == 4


@pytest.mark.parametrize(
    ("layout", "heads_first"), [(None, None), ("LBHNC", True), ("LBNHC", False)]
)
def test_the_declared_layout_says_whether_heads_come_first(layout, heads_first):
    """What the worker is told about an ambiguous shape comes from vLLM's resolved
    ``KVCacheLayout`` (heads then tokens innermost), None while it is not resolved."""
    from vllm.config import CacheConfig

    cache_config = CacheConfig()
    cache_config.kv_cache_layout = layout
    assert declared_heads_first(SimpleNamespace(cache_config=cache_config)) is heads_first


@pytest.mark.parametrize(
    ("decode_heads", "match"),
    [(2, "holds 2 KV heads in all here"), (8, "holds 8 KV heads in all here")],
)
def test_engines_of_different_tp_sizes_must_hold_the_same_heads_in_all(decode_heads, match):
    p, _ = layout_of(cpu_cache(2, True), 2, 2)  # 4 heads in all
    d, _ = layout_of(cpu_cache(decode_heads, False), decode_heads, 1)
    with pytest.raises(LayoutMismatch, match=match):
        d.check_compatible(p)


def test_a_head_slice_outside_either_view_is_refused():
    p, _ = layout_of(cpu_cache(2, True), 2, 2)
    d, _ = layout_of(cpu_cache(4, False), 4, 1)
    for bad in (HeadSlice(0, 1, 0, 2), HeadSlice(0, 0, 3, 2), HeadSlice(0, 0, 0, 0)):
        with pytest.raises(LayoutMismatch, match="not addressable"):
            block_spans(d.views[0], p.views[0], [(1, 1)], bad)


def test_a_lease_with_several_readers_is_released_when_all_of_them_are_done():
    leases = LeaseTable(10.0, clock=lambda: 0.0)
    leases.grant("a")
    slots = [("d", 0), ("d", 1)]
    assert leases.claim("a", "t0", ("d", 0), slots) == "t0"
    assert leases.claim("a", "t9", ("d", 0), slots) == "t0"  # the first claim of a slot stands
    with pytest.raises(ValueError, match="leased to other readers"):
        leases.claim("a", "t2", ("other", 1), slots)
    assert not leases.done("a", "t0")  # rank 1 has not even claimed yet
    assert leases.claim("a", "t1", ("d", 1)) == "t1"  # the slots are the first claim's
    assert leases.holders("a") == {"t0", "t1"}
    assert not leases.done("a", "t0")
    assert leases.done("a", "t1") and "a" not in leases
    leases.grant("b")
    assert leases.done("b", "anyone")  # nobody claimed it: a release


def test_a_reader_that_never_claimed_its_slot_closes_it_with_its_done():
    """Rank 1 fails before its claim and says done naming its slot: the slot is closed (no
    holder: nobody claims it later), and the lease released once rank 0, which claimed, is
    done too. A done naming a slot someone else claimed, or one outside the lease's slots,
    closes nothing."""
    leases = LeaseTable(10.0, clock=lambda: 0.0)
    leases.grant("a")
    slots = [("d", 0), ("d", 1)]
    assert leases.claim("a", "t0", ("d", 0), slots) == "t0"
    assert leases.unclaimed("a", ("d", 1)) and not leases.unclaimed("a", ("d", 0))
    assert not leases.unclaimed("a", ("other", 1))
    assert not leases.done("a", "t9", ("d", 0))  # t0's slot: not closed by another
    assert not leases.done("a", "t9", ("other", 1))
    assert not leases.done("a", "t1", ("d", 1))  # closed; rank 0 still reads
    assert not leases.unclaimed("a", ("d", 1))
    assert leases.holders("a") == {"t0"}  # the closer holds nothing
    with pytest.raises(ValueError, match="closed unread"):
        leases.claim("a", "t1", ("d", 1))
    assert not leases.done("a", "t9", ("d", 1))  # closed already: nothing more
    assert leases.done("a", "t0") and "a" not in leases
    leases.grant("b")
    assert leases.claim("b", "t0", ("d", 0), slots) == "t0"
    assert not leases.done("b", "t0")
    assert leases.done("b", "t1", ("d", 1)) and "b" not in leases  # rank 0 was done first


def test_pairs_of_every_size_up_to_four_agree_with_the_matrix():
    """Every (prefill TP, decode TP) up to 4 for 4 heads: the matrix accepts it exactly when
    the mapping can be computed, and then reads cover each decode rank's heads."""
    for p_tp, d_tp in itertools.product(range(1, 5), repeat=2):
        refusal = tp_refusal(p_tp, d_tp, kv_heads=4)
        if refusal is not None:
            assert 4 % p_tp or 4 % d_tp, (p_tp, d_tp)
            with pytest.raises(ValueError):
                head_slices(0, d_tp, p_tp, 4)
            continue
        for q in range(d_tp):
            assert sum(s.count for s in head_slices(q, d_tp, p_tp, 4)) == 4 // d_tp


def test_a_layout_that_knows_its_heads_differs_from_one_that_does_not():
    """Same shapes, one side told its caches are head-major and the other not: a mismatch
    named by the key, never a crash; a layout without heads keeps its former fingerprint
    keys (the tiered cache's block files are named by it)."""
    cache = cpu_cache(2, True)
    known, _ = layout_of(cache, 2, 1)
    unknown, _ = layout_from_caches(
        cache, num_blocks=NUM_BLOCKS, block_size=BLOCK, model={"layers": 2, "tp_size": 1}
    )
    assert "heads" not in unknown.views[0].shape_key()
    with pytest.raises(LayoutMismatch, match="heads: 2 here, None remote"):
        known.check_compatible(unknown)
