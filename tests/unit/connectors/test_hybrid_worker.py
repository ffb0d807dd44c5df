"""PdExtMambaStateConnector's worker side across two processes, with CPU caches laid out as
vLLM's hybrid allocator lays out a GraniteMoeHybrid's: each storage is shared by a Mamba layer
(one int8 view of whole state pages) and an attention layer (bf16 blocks), and block ids come
per KV cache group. The prefill worker runs in a spawned process; the decode worker pulls over
real Mooncake engines and must end with the same state pages and attention blocks, byte for
byte, and nothing else touched. Over our ``tcp`` backend (in one process) it may read only the
pages and blocks leased to it."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from tests.unit.connectors.conftest import requires_mooncake
from vllm_pd_ext.connectors.common.config import TransferConfig
from vllm_pd_ext.connectors.common.metadata import (
    PdTransferMetadata,
    RecvSpec,
    RemoteRef,
    SendSpec,
)
from vllm_pd_ext.connectors.common.worker import TransferWorker
from vllm_pd_ext.util.vllm_process import free_port

pytestmark = requires_mooncake

NUM_BLOCKS, PAGE = 24, 16384  # bytes per page, shared by both groups
STATE_BYTES = 3 * 40 * 2 + 4 * 16 * 8 * 4  # conv (bf16) + ssm (fp32) state of one layer
ATTN_BLOCK, HEADS, HEAD = 16, 2, 64  # 16 tokens x 2 heads x 2*64 bf16 = 8 KiB per block
GROUPS = {
    "model.layers.0.mixer": 0,
    "model.layers.2.mixer": 0,
    "model.layers.1.attn": 1,
    "model.layers.3.attn": 1,
}


def hybrid_caches(seed: int | None, heads: int = HEADS) -> dict[str, torch.Tensor]:
    """Two storages; layer 0/1 share the first, 2/3 the second (as vLLM's KVCacheTensors)."""
    out = {}
    for pair, (mamba, attn) in enumerate(
        (
            ("model.layers.0.mixer", "model.layers.1.attn"),
            ("model.layers.2.mixer", "model.layers.3.attn"),
        )
    ):
        storage = torch.zeros(NUM_BLOCKS * PAGE, dtype=torch.uint8)
        if seed is not None:
            g = torch.Generator().manual_seed(seed + pair)
            storage.copy_(torch.randint(0, 256, storage.shape, generator=g, dtype=torch.uint8))
        out[mamba] = torch.as_strided(
            storage.view(torch.int8),
            (NUM_BLOCKS, 1, 1, STATE_BYTES),
            (PAGE, STATE_BYTES, STATE_BYTES, 1),
        )
        elems = PAGE // 2
        out[attn] = torch.as_strided(
            storage.view(torch.bfloat16),
            (NUM_BLOCKS, heads, ATTN_BLOCK, 2 * HEAD),
            (elems, ATTN_BLOCK * 2 * HEAD, 2 * HEAD, 1),
        )
    return out


def worker(role: str, port: int, heads: int = HEADS, backend: str = "mooncake") -> TransferWorker:
    cfg = TransferConfig(
        backend=backend,
        backend_settings={"host": "127.0.0.1"},
        transfer_timeout_s=30.0,  # loose: a loaded host is slow, not broken
        handshake_timeout_s=30.0,
    )
    return TransferWorker(
        cfg,
        engine_id=f"engine-{role}",
        role=role,
        tp_rank=0,
        tp_size=1,
        side_host="127.0.0.1",
        side_port=port,
        kv_ip="127.0.0.1",
        num_blocks=NUM_BLOCKS,
        block_sizes=(512, ATTN_BLOCK),
        model={"architectures": ["GraniteMoeHybridForCausalLM"], "heads": heads},
        group_of=GROUPS,
    )


def prefill_process(port: int, blocks: tuple, conn) -> None:
    """Child: a prefill worker holding ``blocks`` until the decode side says done; sends
    True once it freed them (False if not within 180 s), then waits for "stop"."""
    p = worker("kv_producer", port)
    p.register_kv_caches(hybrid_caches(seed=7))
    p.bind(PdTransferMetadata(send=[SendSpec("p-req", "read", blocks)]))
    conn.send("ready")
    deadline = time.monotonic() + 180
    freed = False
    while not freed and time.monotonic() < deadline:
        sending, _ = p.get_finished({"p-req"})
        freed = bool(sending)
        time.sleep(0.01)
    conn.send(freed)
    conn.poll(60)
    p.shutdown()


def blocks_for(n_tokens: int) -> int:
    return -(-n_tokens // ATTN_BLOCK)


@pytest.mark.parametrize("prompt_tokens", [65, 81], ids=["n-1-multiple-of-block", "n-1-not"])
def test_state_pages_and_attention_blocks_cross_processes(prompt_tokens):
    n = prompt_tokens - 1
    p_state, p_attn = (3,), tuple(range(5, 5 + blocks_for(n)))
    d_state, d_attn = (11,), tuple(range(14, 14 + blocks_for(n)))
    port = free_port()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=prefill_process, args=(port, (p_state, p_attn), child), daemon=True)
    proc.start()
    try:
        assert parent.poll(180) and parent.recv() == "ready"
        d = worker("kv_consumer", free_port())
        dc = hybrid_caches(seed=None)
        d.register_kv_caches(dc)
        pairs = (tuple(zip(d_state, p_state, strict=True)), tuple(zip(d_attn, p_attn, strict=True)))
        ref = RemoteRef("engine-kv_producer", "127.0.0.1", port, "p-req")
        d.bind(PdTransferMetadata(recv=[RecvSpec("d-req", "read", ref, pairs, (d_state, d_attn))]))
        d.start_load_kv()
        deadline = time.monotonic() + 90
        done = None
        while not done and time.monotonic() < deadline:
            done = d.get_finished(set())[1]
            time.sleep(0.01)
        assert done == {"d-req"} and d.get_block_ids_with_load_errors() == set()
        assert d.take_failed_loads() == set()
        assert parent.poll(180) and parent.recv() is True  # P freed its blocks on "done"
        parent.send("stop")
        d.shutdown()
    finally:
        proc.join(timeout=20)
        if proc.is_alive():
            proc.kill()
    pc = hybrid_caches(seed=7)
    for layer, group in GROUPS.items():
        moved = (
            dict(zip(d_state, p_state, strict=True))
            if group == 0
            else dict(zip(d_attn, p_attn, strict=True))
        )
        for b in range(NUM_BLOCKS):
            if b in moved:
                got, want = dc[layer][b].view(torch.uint8), pc[layer][moved[b]].view(torch.uint8)
                assert torch.equal(got, want), (layer, b)  # bytes: random bf16 holds NaNs
            elif b not in d_state + d_attn:  # pages are shared: check untouched ones only
                assert torch.count_nonzero(dc[layer][b].view(torch.uint8)) == 0, (layer, b)


def test_a_peer_reads_only_the_state_pages_and_blocks_leased_to_it():
    """Over ``tcp``: a load through the whole READ path (claim, read of both KV cache
    groups, "done") succeeds; the decode transport that claimed another lease reads its state
    page and attention blocks, while the state page of a request leased to nobody, an
    attention block of it, and group 1's block on the leased state page (the same storage,
    more bytes than the state) are refused and leave the decode caches untouched."""
    from vllm_pd_ext.connectors.common.side_channel import post_json
    from vllm_pd_ext.transport import TransferError

    port = free_port()
    p = worker("kv_producer", port, backend="tcp")
    d = worker("kv_consumer", free_port(), backend="tcp")
    try:
        pc, dc = hybrid_caches(seed=7), hybrid_caches(seed=None)
        p.register_kv_caches(pc)
        d.register_kv_caches(dc)
        assert d.transport is not None
        p.bind(
            PdTransferMetadata(
                send=[
                    SendSpec("p-first", "read", ((1,), (8, 9))),
                    SendSpec("p-req", "read", ((3,), (5, 6))),
                    SendSpec("p-other", "read", ((4,), (7,))),
                ]
            )
        )
        p.get_finished({"p-first", "p-req", "p-other"})
        first = RemoteRef("engine-kv_producer", "127.0.0.1", port, "p-first")
        pairs = (((10, 1),), ((17, 8), (18, 9)))
        d.bind(
            PdTransferMetadata(recv=[RecvSpec("d-req", "read", first, pairs, ((10,), (17, 18)))])
        )
        d.start_load_kv()
        deadline = time.monotonic() + 20
        while not d.get_finished(set())[1]:
            assert time.monotonic() < deadline, "the load never finished"
            time.sleep(0.01)
        assert d.take_failed_loads() == set()
        while p.get_finished(set())[0] != {"p-first"}:
            assert time.monotonic() < deadline, "the prefill side never freed p-first"
            time.sleep(0.01)
        ref = RemoteRef("engine-kv_producer", "127.0.0.1", port, "p-req")
        post_json(
            "127.0.0.1", port, "/renew", {"req": "p-req", "engine_id": d.transport.engine_id}, 5
        )
        peer = d._peer(ref)
        d._read([peer], (((11, 3),), ((14, 5), (15, 6))), deadline)
        for layer, group in GROUPS.items():
            moved = [(10, 1), (11, 3)] if group == 0 else [(17, 8), (18, 9), (14, 5), (15, 6)]
            for mine, theirs in moved:
                got, want = dc[layer][mine].view(torch.uint8), pc[layer][theirs].view(torch.uint8)
                assert torch.equal(got, want), (layer, mine)
        for outside in [(((12, 4),), ()), ((), ((16, 7),)), ((), ((12, 3),))]:
            with pytest.raises(TransferError, match="read outside the spans granted"):
                d._read([peer], outside, deadline)
        for layer in GROUPS:
            for b in (12, 16):
                assert torch.count_nonzero(dc[layer][b].view(torch.uint8)) == 0, (layer, b)
    finally:
        d.shutdown()
        p.shutdown()


def test_hybrid_layout_mismatch_is_refused_at_handshake():
    port = free_port()
    p = worker("kv_producer", port)
    p.register_kv_caches(hybrid_caches(seed=1))
    d = worker("kv_consumer", free_port(), heads=4)
    d.register_kv_caches(_wider())
    try:
        ref = RemoteRef("engine-kv_producer", "127.0.0.1", port, "p-req")
        d.bind(
            PdTransferMetadata(
                recv=[RecvSpec("d-req", "read", ref, (((11, 3),), ((14, 5),)), ((11,), (14,)))]
            )
        )
        d.start_load_kv()
        deadline = time.monotonic() + 20
        done = None
        while not done and time.monotonic() < deadline:
            done = d.get_finished(set())[1]
            time.sleep(0.01)
        assert done == {"d-req"}
        assert d.take_failed_loads() == {"d-req"}  # by request: block ids repeat across groups
        assert d.get_block_ids_with_load_errors() == set()
    finally:
        d.shutdown()
        p.shutdown()


def _wider() -> dict[str, torch.Tensor]:
    """Same pages, but attention blocks of 4 heads x 8 tokens (a different model)."""
    out = hybrid_caches(seed=None)
    for layer in ("model.layers.1.attn", "model.layers.3.attn"):
        t = out[layer]
        out[layer] = torch.as_strided(
            t,
            (NUM_BLOCKS, 4, ATTN_BLOCK // 2, 2 * HEAD),
            (PAGE // 2, ATTN_BLOCK // 2 * 2 * HEAD, 2 * HEAD, 1),
        )
    return out
