"""Mamba2 state pages between engines of different TP sizes (``parallel.py``: Mamba2State,
state_page_spans, state_refusal; ``layout.py``: state views, state_block_spans): one model's
state, sharded over each side's ranks by vLLM's own shape calculator and weight loader (the
conv state's channels are the conv weight's rows), assembled on the decode ranks by copying
bytes along our spans, must equal the state vLLM would hold there."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from vllm_pd_ext.connectors.common.layout import (
    LayoutMismatch,
    layout_from_caches,
    state_block_spans,
)
from vllm_pd_ext.connectors.common.parallel import (
    Mamba2State,
    source_ranks,
    state_page_spans,
    state_refusal,
    total_groups,
)

HEADS, HEAD_DIM, STATE, KERNEL = 8, 4, 4, 4
NUM_BLOCKS, PAD = 6, 64  # vLLM pads state pages to the attention page size


def model_state(groups: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A TP 1 rank's conv state, channels first (``x | B | C`` x rows; bf16), and SSM state."""
    g = torch.Generator().manual_seed(seed)
    channels = HEADS * HEAD_DIM + 2 * groups * STATE
    conv = torch.randn(channels, KERNEL - 1, generator=g).to(torch.bfloat16)
    return conv, torch.randn(HEADS, HEAD_DIM, STATE, generator=g)


def shard(
    full: tuple[torch.Tensor, torch.Tensor], groups: int, tp: int, rank: int
) -> tuple[tuple[tuple[int, ...], ...], bytes]:
    """Rank ``rank`` of ``tp``'s state shapes and page bytes, as vLLM builds them:
    ``MambaStateShapeCalculator`` shapes, ``mamba_v2_sharded_weight_loader`` splits (what
    ``MambaMixer2`` sets up for conv1d; with groups the TP size divides, the same split as
    its MergedColumnParallelLinear), the page packed as ``MambaBase.bind_kv_cache`` reads it."""
    from vllm.model_executor.layers.mamba.mamba_mixer2 import mamba_v2_sharded_weight_loader
    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateShapeCalculator,
        is_conv_state_dim_first,
    )

    conv_shape, ssm_shape = MambaStateShapeCalculator.mamba2_state_shape(
        tp_world_size=tp,
        intermediate_size=HEADS * HEAD_DIM,
        n_groups=groups,
        num_heads=HEADS,
        head_dim=HEAD_DIM,
        state_size=STATE,
        conv_kernel=KERNEL,
    )
    padded = groups + MambaStateShapeCalculator.extra_groups_for_head_shards(groups, tp)
    group_part = (padded * STATE, (padded - groups) * STATE, padded != groups)
    parts = [(HEADS * HEAD_DIM, 0, False), group_part, group_part]
    channels = conv_shape[0] if is_conv_state_dim_first() else conv_shape[1]
    conv = torch.zeros(channels, KERNEL - 1, dtype=torch.bfloat16)
    mamba_v2_sharded_weight_loader(parts, tp, rank)(conv, full[0])
    ssm = torch.zeros(ssm_shape)
    mamba_v2_sharded_weight_loader([(HEADS, 0, False)], tp, rank)(ssm, full[1])
    oriented = conv if is_conv_state_dim_first() else conv.T.contiguous()
    assert tuple(oriented.shape) == tuple(conv_shape)
    page = oriented.view(torch.uint8).numpy().tobytes() + ssm.view(torch.uint8).numpy().tobytes()
    return (tuple(conv_shape), tuple(ssm_shape)), page


def pages(state_shapes, page: bytes | None, tp: int, rank: int):
    """One layer's cache as vLLM hands it to a connector (an int8 ``[blocks, 1, 1, page]``
    view), ``page`` in block 1 (None: all zeros), and its layout."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    state = Mamba2State.from_shapes(
        state_shapes, (2, 4), tp_size=tp, channels_first=is_conv_state_dim_first()
    )
    raw = torch.zeros(NUM_BLOCKS, 1, 1, state.page_bytes + PAD, dtype=torch.int8)
    if page is not None:
        raw[1, 0, 0, : len(page)] = torch.frombuffer(bytearray(page), dtype=torch.int8)
    cache = {"model.layers.0.mixer": raw}
    layout, regions = layout_from_caches(
        cache,
        num_blocks=NUM_BLOCKS,
        block_size=16,
        model={"layers": 1},
        states={0: state},
        tp_size=tp,
        tp_rank=rank,
    )
    return raw, layout, regions


def assemble(groups: int, prefill_tp: int, decode_tp: int) -> None:
    """Every decode rank reads its sources' spans into block 2 and must hold vLLM's state."""
    full = model_state(groups)
    prefill = []
    for r in range(prefill_tp):
        shapes, page = shard(full, groups, prefill_tp, r)
        prefill.append(pages(shapes, page, prefill_tp, r))
    for q in range(decode_tp):
        shapes, want = shard(full, groups, decode_tp, q)
        raw, mine, local = pages(shapes, None, decode_tp, q)
        sources = source_ranks(q, decode_tp, prefill_tp)
        view = mine.views[0]
        spans = state_page_spans(view.state, q, prefill[0][1].views[0].state, sources)
        for r in sources:
            _, theirs, remote = prefill[r]
            mine.check_compatible(theirs)
            rows = state_block_spans(view, theirs.views[0], [(2, 1)], spans[r])
            for lo, ro, n in rows:
                local[view.region][lo : lo + n] = remote[theirs.views[0].region][ro : ro + n]
        got = raw[2, 0, 0, : len(want)].view(torch.uint8).numpy().tobytes()
        assert got == want, (q, groups, prefill_tp, decode_tp)
        assert (
            torch.count_nonzero(raw[1]) == 0 and torch.count_nonzero(raw[2, 0, 0, len(want) :]) == 0
        )


@pytest.fixture(params=["SD", "DS"])
def conv_layout(request, monkeypatch):
    """vLLM's two conv state layouts (``VLLM_SSM_CONV_STATE_LAYOUT``; SD by default)."""
    from vllm.model_executor.layers.mamba.mamba_utils import (
        get_conv_state_layout,
        is_conv_state_dim_first,
    )

    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", request.param)
    get_conv_state_layout.cache_clear()  # vLLM reads it once per process
    assert is_conv_state_dim_first() == (request.param == "DS")
    yield request.param
    get_conv_state_layout.cache_clear()


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2), (4, 2), (2, 4), (4, 1)])
def test_split_groups_assemble_into_the_decode_ranks_state(conv_layout, prefill_tp, decode_tp):
    # 4 groups: each TP size divides them, each rank holds its share of B and C
    assemble(4, prefill_tp, decode_tp)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2), (4, 2), (2, 4)])
def test_one_group_replicated_on_every_rank_is_read_once(conv_layout, prefill_tp, decode_tp):
    # 1 group: every rank of TP > 1 holds all of B and C (vLLM's extra groups for head shards)
    assemble(1, prefill_tp, decode_tp)
    mine, theirs = rank_state(1, decode_tp), rank_state(1, prefill_tp)
    spans = state_page_spans(mine, 0, theirs, source_ranks(0, decode_tp, prefill_tp))
    if prefill_tp > decode_tp:  # B and C from the first source rank only
        assert len(spans[0]) > len(spans[1])


def rank_state(groups: int, tp: int) -> Mamba2State:
    """Rank 0 of ``tp``'s state, from the shapes vLLM gives it."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    shapes, _ = shard(model_state(groups), groups, tp, 0)
    return Mamba2State.from_shapes(
        shapes, (2, 4), tp_size=tp, channels_first=is_conv_state_dim_first()
    )


def test_the_model_groups_are_the_one_count_both_sides_fit(conv_layout):
    assert [rank_state(1, tp).groups for tp in (1, 2, 4)] == [1, 1, 1]
    assert total_groups(rank_state(1, 2), rank_state(1, 4)) == 1
    assert total_groups(rank_state(1, 1), rank_state(1, 2)) == 1
    assert total_groups(rank_state(2, 1), rank_state(2, 2)) == 2
    assert total_groups(rank_state(4, 4), rank_state(4, 2)) == 4
    # 4 groups at TP 1 and one a rank at TP 2 (a model of 1 or 2): no model fits both
    assert total_groups(rank_state(4, 1), rank_state(1, 2)) is None


def test_state_laid_out_or_shaped_differently_is_refused():
    sd = Mamba2State(2, 4, 4, 4, 1, 3, False, 2, 4)
    assert state_refusal(sd, Mamba2State(1, 8, 4, 4, 1, 3, False, 2, 4)) is None
    for other, why in (
        (Mamba2State(1, 8, 4, 4, 1, 3, True, 2, 4), "channels_first: False here, True remote"),
        (Mamba2State(1, 6, 4, 4, 1, 3, False, 2, 4), "8 SSM heads in all here"),
        (Mamba2State(1, 8, 4, 4, 1, 3, False, 2, 2), "ssm_itemsize: 4 bytes here, 2 remote"),
        (Mamba2State(1, 8, 4, 4, 1, 4, False, 2, 4), "conv_rows: 3 here, 4 remote"),
        (Mamba2State(1, 8, 4, 4, 4, 3, False, 2, 4), "groups do not fit both sides"),
    ):
        got = state_refusal(sd, other)
        assert got is not None and why in got, got
        with pytest.raises(ValueError, match="Mamba2 state"):
            state_page_spans(sd, 0, other, [0])


def test_a_page_that_is_not_mamba2_state_is_refused_between_tp_sizes(conv_layout):
    full = model_state(1)
    shapes, page = shard(full, 1, 2, 0)
    _, theirs, _ = pages(shapes, page, 2, 0)
    raw = torch.zeros(NUM_BLOCKS, 1, 1, 2048, dtype=torch.int8)  # a Mamba1 page: no state
    mine, _ = layout_from_caches(
        {"model.layers.0.mixer": raw},
        num_blocks=NUM_BLOCKS,
        block_size=16,
        model={"layers": 1},
        tp_size=1,
    )
    with pytest.raises(LayoutMismatch, match="is not a Mamba2 state page split by heads"):
        mine.check_compatible(theirs)
    with pytest.raises(ValueError, match="not Mamba2's"):
        Mamba2State.from_shapes(((3, 32), (32, 16)), (2, 4), tp_size=1, channels_first=False)


def test_a_peer_state_description_its_own_layout_contradicts_is_refused(conv_layout):
    """What a peer says of its state page is checked against the rest of what it sent: the
    TP size its layout gives, sizes of at least one, a page that fits its pieces."""
    full = model_state(1)
    shapes, page = shard(full, 1, 1, 0)
    _, mine, _ = pages(shapes, page, 1, 0)
    shapes, page = shard(full, 1, 2, 0)
    _, theirs, _ = pages(shapes, page, 2, 0)
    mine.check_compatible(theirs)  # as sent: fine
    view = theirs.views[0]
    assert view.state is not None
    for changed, why in (
        (dataclasses.replace(view, state=dataclasses.replace(view.state, tp_size=4)), "for TP 4"),
        (
            dataclasses.replace(view, state=dataclasses.replace(view.state, heads=-8, groups=-1)),
            "not a Mamba2 state page",
        ),
        (dataclasses.replace(view, piece_len=view.state.page_bytes - 1), "not a Mamba2 state"),
    ):
        crafted = dataclasses.replace(theirs, views=(changed,))
        with pytest.raises(LayoutMismatch, match=why):
            mine.check_compatible(crafted)


@pytest.mark.parametrize("name", ["mamba_n_groups", "n_groups", "mamba_ngroups"])
def test_models_of_different_group_counts_are_refused_between_tp_sizes(conv_layout, name):
    """A model of 2 groups at TP 2 has the per-rank state shapes of one of 1 group: the group
    count is a model fact (read from the config's name for it), so they do not pair."""
    from types import SimpleNamespace

    from vllm_pd_ext.connectors.common.shell import model_facts

    def facts(groups: int) -> dict:
        hf = SimpleNamespace(architectures=["GraniteMoeHybridForCausalLM"], **{name: groups})
        model_config = SimpleNamespace(
            hf_config=hf,
            hf_text_config=hf,
            get_num_layers=lambda _pc: 1,
            get_total_num_kv_heads=lambda: 4,
        )
        vllm_config = SimpleNamespace(
            model_config=model_config,
            parallel_config=SimpleNamespace(tensor_parallel_size=1),
            cache_config=SimpleNamespace(cache_dtype="auto"),
        )
        kv_cache = SimpleNamespace(has_mamba_layers=True, kv_cache_groups=[])
        return model_facts(vllm_config, kv_cache)

    assert facts(2)["ssm_groups"] == 2
    full = model_state(1)
    shapes, page = shard(full, 1, 1, 0)
    _, mine, _ = pages(shapes, page, 1, 0)
    shapes, page = shard(full, 1, 2, 0)
    _, theirs, _ = pages(shapes, page, 2, 0)
    mine = dataclasses.replace(mine, model={**mine.model, "ssm_groups": facts(1)["ssm_groups"]})
    same = dataclasses.replace(theirs, model={**theirs.model, "ssm_groups": 1})
    mine.check_compatible(same)
    other = dataclasses.replace(theirs, model={**theirs.model, "ssm_groups": 2})
    with pytest.raises(LayoutMismatch, match="model ssm_groups: 1 here, 2 remote"):
        mine.check_compatible(other)


def test_state_spans_stay_inside_both_pages():
    monkey = Mamba2State(1, 8, 4, 4, 1, 3, False, 2, 4)
    raw = torch.zeros(NUM_BLOCKS, 1, 1, monkey.page_bytes, dtype=torch.int8)
    layout, _ = layout_from_caches(
        {"l": raw}, num_blocks=NUM_BLOCKS, block_size=16, model={}, states={0: monkey}
    )
    view = layout.views[0]
    assert view.state == monkey
    with pytest.raises(LayoutMismatch, match="state spans outside"):
        state_block_spans(view, view, [(0, 0)], [(monkey.page_bytes - 4, 0, 8)])
    with pytest.raises(LayoutMismatch, match="block ids out of range"):
        state_block_spans(view, view, [(NUM_BLOCKS, 0)], [(0, 0, 4)])
    rows = state_block_spans(view, view, np.array([[1, 2]]), [(0, 4, 8)])
    assert rows.tolist() == [[view.block_stride + 0, 2 * view.block_stride + 4, 8]]


ATTN_HEADS, ATTN_BLOCK, ATTN_HEAD = 4, 16, 8
LAYERS = {"model.layers.0.mixer": 0, "model.layers.1.attn": 1}  # KV cache group of each


def hybrid_worker(role: str, port: int, tp: int, rank: int, state: Mamba2State):
    """A worker of a hybrid model (one Mamba2 layer, one attention layer of ``ATTN_HEADS``
    KV heads, head-major as on the CPU backend) at rank ``rank`` of ``tp``, over ``tcp``."""
    from vllm_pd_ext.connectors.common.config import TransferConfig
    from vllm_pd_ext.connectors.common.worker import TransferWorker

    cfg = TransferConfig(
        backend="tcp",
        backend_settings={"host": "127.0.0.1"},
        side_channel_host="127.0.0.1",
        side_channel_port=port,
        transfer_timeout_s=10.0,
        handshake_timeout_s=5.0,
    )
    return TransferWorker(
        cfg,
        engine_id=f"engine-{role}-{port}",
        role=role,
        tp_rank=rank,
        tp_size=tp,
        side_host="127.0.0.1",
        side_port=port,
        kv_ip="127.0.0.1",
        num_blocks=NUM_BLOCKS,
        block_sizes=(64, ATTN_BLOCK),
        model={"layers": 2, "kv_heads": ATTN_HEADS},
        group_of=LAYERS,
        head_major={1: ATTN_HEADS // tp},
        states={0: state},
    )


def hybrid_engine(role, port, full, groups, tp, fill):
    """Every rank of one engine: (workers, caches, each rank's state page as vLLM holds it)."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    workers, caches, want = [], [], []
    g = torch.Generator().manual_seed(7)
    attention = torch.randn(NUM_BLOCKS, ATTN_HEADS, ATTN_BLOCK, 2 * ATTN_HEAD, generator=g)
    for r in range(tp):
        shapes, page = shard(full, groups, tp, r)
        state = Mamba2State.from_shapes(
            shapes, (2, 4), tp_size=tp, channels_first=is_conv_state_dim_first()
        )
        raw, *_ = pages(shapes, page if fill else None, tp, r)
        per = ATTN_HEADS // tp
        attn = attention[:, r * per : (r + 1) * per].clone()
        cache = {"model.layers.0.mixer": raw, "model.layers.1.attn": attn if fill else attn * 0}
        w = hybrid_worker(role, port, tp, r, state)
        w.register_kv_caches(cache)
        workers.append(w)
        caches.append(cache)
        want.append((page, attn))
    return workers, caches, want


@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
def test_a_decode_rank_reads_its_state_and_heads_from_a_prefill_of_another_tp_size(
    conv_layout, prefill_tp, decode_tp, groups
):
    """READ over a real transport (``tcp``), hybrid model: each decode rank handshakes with
    the prefill ranks it reads (the state views are compatible between the sizes), reads its
    parts of the state page and its KV heads, and ends with the state page vLLM would hold at
    its rank and its heads' blocks; the prefill ranks free once read."""
    from tests.unit.connectors.test_worker_side import poll, recv
    from vllm_pd_ext.connectors.common.metadata import (
        PdTransferMetadata,
        RecvSpec,
        RemoteRef,
        SendSpec,
    )
    from vllm_pd_ext.util.vllm_process import free_port

    full = model_state(groups)
    port = free_port()
    ps, _, _ = hybrid_engine("kv_producer", port, full, groups, prefill_tp, fill=True)
    ds, dcs, want = hybrid_engine("kv_consumer", free_port(), full, groups, decode_tp, False)
    try:
        for p in ps:  # state page 1, attention blocks 2 and 3
            p.bind(PdTransferMetadata(send=[SendSpec("p-req", "read", ((1,), (2, 3)))]))
            assert p.get_finished({"p-req"}) == (None, None)
        ref = RemoteRef(ps[0].engine_id, "127.0.0.1", port, "p-req", tp_size=prefill_tp)
        pairs = (((2, 1),), ((4, 2), (5, 3)))
        for d in ds:
            recv(d, RecvSpec("d-req", "read", ref, pairs, ((2,), (4, 5))))
            assert poll(lambda d=d: d.get_finished(set())[1], "a rank's load") == {"d-req"}
            assert d.take_failed_loads() == set()  # several groups: failures by request
        assert_decode_ranks_hold(dcs, want)
        for p in ps:
            assert poll(lambda p=p: p.get_finished(set())[0], "a rank's free") == {"p-req"}
    finally:
        for w in ds + ps:
            w.shutdown()


def assert_decode_ranks_hold(dcs, want) -> None:
    """Each decode rank's cache holds vLLM's state page for it in block 2 (block 1 untouched)
    and its heads of attention blocks 2 and 3 in its blocks 4 and 5."""
    for dc, (page, attn) in zip(dcs, want, strict=True):
        raw = dc["model.layers.0.mixer"]
        assert raw[2, 0, 0, : len(page)].view(torch.uint8).numpy().tobytes() == page
        assert torch.count_nonzero(raw[1]) == 0
        assert torch.equal(dc["model.layers.1.attn"][4], attn[2])
        assert torch.equal(dc["model.layers.1.attn"][5], attn[3])


@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
def test_prefill_ranks_write_their_state_parts_into_a_decode_of_another_tp_size(
    conv_layout, prefill_tp, decode_tp, groups
):
    """WRITE over ``tcp``, hybrid model: every decode rank offers its blocks, each prefill
    rank writes its parts of the state page and its KV heads into their place in each decode
    rank it holds some of; every decode rank ends with vLLM's state page and heads for it."""
    from tests.unit.connectors.test_worker_side import PROMPT_HASH, poll, recv
    from vllm_pd_ext.connectors.common.metadata import (
        PdTransferMetadata,
        PushSpec,
        RecvSpec,
        RemoteRef,
        SendSpec,
    )
    from vllm_pd_ext.util.vllm_process import free_port

    full = model_state(groups)
    port = free_port()
    ps, pcs, _ = hybrid_engine("kv_producer", port, full, groups, prefill_tp, fill=True)
    ds, dcs, want = hybrid_engine("kv_consumer", free_port(), full, groups, decode_tp, False)
    blocks = ((1,), (2, 3))
    try:
        for p, pc in zip(ps, pcs, strict=True):
            p.bind(PdTransferMetadata(push=[PushSpec("p-req", "t-s", blocks, PROMPT_HASH)]))
            for layer in pc:
                p.save_kv_layer(layer)
            p.wait_for_save()
        ref = RemoteRef("", "127.0.0.1", port, None)
        for d in ds:  # (decode block, prompt block position) per group
            offer = (((2, 0),), ((4, 0), (5, 1)))
            local = ((2,), (4, 5))
            spec = RecvSpec("d-req", "write", ref, offer, local, "t-s", prompt_hash=PROMPT_HASH)
            recv(d, spec)
        for p in ps:
            p.bind(PdTransferMetadata(send=[SendSpec("p-req", "write", blocks, "t-s")]))
        for d in ds:
            assert poll(lambda d=d: d.get_finished(set())[1], "a rank's load") == {"d-req"}
            assert d.take_failed_loads() == set()
        assert_decode_ranks_hold(dcs, want)
        for p in ps:
            assert poll(lambda p=p: p.get_finished({"p-req"})[0], "a rank's free") == {"p-req"}
    finally:
        for w in ds + ps:
            w.shutdown()
