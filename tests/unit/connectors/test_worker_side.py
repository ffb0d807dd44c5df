"""PdExtMoRIIOConnector's worker side with CPU KV caches and real transports.

A prefill and a decode ``TransferWorker`` live in this process, each with its own transport
(every test runs over Mooncake's engine and over our ``tcp`` backend) on 127.0.0.1 and its
own caches shaped like vLLM's CPU backend (``[blocks, kv_heads, block_size, 2 * head_size]``
per layer). The test plays the scheduler:
it binds the metadata each step would carry and calls ``get_finished`` as the runner does
(one test runs vLLM's real Scheduler on both sides instead, and hands its metadata over).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time

import pytest
import torch

from tests.unit.connectors.conftest import requires_mooncake
from tests.unit.connectors.sched_harness import (
    make_request,
    make_scheduler,
    make_vllm_config,
    step,
)
from tests.unit.slow_peers import closed_within, connect_from
from vllm_pd_ext.connectors.common.config import TransferConfig
from vllm_pd_ext.connectors.common.metadata import (
    PdTransferMetadata,
    PushSpec,
    RecvSpec,
    RemoteRef,
    SendSpec,
)
from vllm_pd_ext.connectors.common.scheduler import prompt_hash
from vllm_pd_ext.connectors.common.side_channel import SideChannelError, post_json
from vllm_pd_ext.connectors.common.worker import HANDSHAKE_VERSION, MAX_OFFERS, TransferWorker
from vllm_pd_ext.transfer_params import WRITE, PdExtWriteDecode, PrefillLeg
from vllm_pd_ext.util.vllm_process import free_port

pytestmark = requires_mooncake

LAYERS, NUM_BLOCKS, BLOCK, HEADS, HEAD = 3, 12, 16, 2, 32
_seq = itertools.count()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def caches(
    fill: bool, heads: int = HEADS, shape: str = "cpu", num_blocks: int = NUM_BLOCKS
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(next(_seq))
    out = {}
    for i in range(LAYERS):
        dims: tuple[int, ...]
        if shape == "cpu":
            dims = (num_blocks, heads, BLOCK, 2 * HEAD)
        else:  # [2, blocks, block_size, heads, head]: K and V apart
            dims = (2, num_blocks, BLOCK, heads, HEAD)
        t = torch.randn(dims, generator=g) if fill else torch.zeros(dims)
        out[f"model.layers.{i}.self_attn.attn"] = t
    return out


def worker(
    role: str,
    port: int,
    clock=None,
    backend: str = "mooncake",
    tp_size: int = 1,
    tp_rank: int = 0,
    key: bytes | None = None,
    num_blocks: int = NUM_BLOCKS,
    heads: int = HEADS,
    kv_heads: int | None = None,
    **cfg,
) -> TransferWorker:
    """A worker whose caches (``caches(heads=heads)``) hold ``heads`` of the model's
    ``kv_heads`` (default ``heads * tp_size``) KV heads, head-major as on the CPU backend."""
    settings = {
        "backend": backend,
        "backend_settings": {"host": "127.0.0.1"},
        "side_channel_host": "127.0.0.1",
        "side_channel_port": port,
        "transfer_timeout_s": 5.0,
        "handshake_timeout_s": 2.0,
        **cfg,
    }
    return TransferWorker(
        TransferConfig(**settings),
        engine_id=f"engine-{role}-{port}",
        role=role,
        tp_rank=tp_rank,
        tp_size=tp_size,
        side_host="127.0.0.1",
        side_port=port,
        kv_ip="127.0.0.1",
        num_blocks=num_blocks,
        block_sizes=(BLOCK,),
        model={"layers": LAYERS, "kv_heads": kv_heads or heads * tp_size},
        head_major={0: heads},
        key=key,
        **({"clock": clock} if clock else {}),
    )


@pytest.fixture(params=["mooncake", "tcp", "cma"])
def backend(request) -> str:
    return request.param


@pytest.fixture
def pair(request, backend):
    """(prefill worker, its caches, decode worker, its caches, side port), over ``backend``."""
    opts = getattr(request, "param", {})
    port = free_port()
    clock = Clock()
    key = opts.get("key")  # the fleet key of both sides, unless "d_key" gives the decode's
    p = worker("kv_producer", port, clock=clock, backend=backend, key=key, **opts.get("p", {}))
    d_key = opts.get("d_key", key)
    d = worker("kv_consumer", free_port(), backend=backend, key=d_key, **opts.get("d", {}))
    shape = opts.get("shape", "cpu")
    pc = caches(True, shape=shape, **opts.get("pcache", {}))
    dc = caches(False, shape=shape, **opts.get("dcache", {}))
    p.register_kv_caches(pc)
    d.register_kv_caches(dc)
    p.clock = clock  # type: ignore[attr-defined]  # the tests move the lease clock
    yield p, pc, d, dc, port
    d.shutdown()
    p.shutdown()


def poll(fn, what: str, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def block(cache: dict[str, torch.Tensor], name: str, b: int) -> torch.Tensor:
    t = cache[name]
    return t[:, b] if t.shape[0] == 2 else t[b]


def assert_copied(src, dst, pairs) -> None:
    for name in src:
        for s, d in pairs:
            assert torch.equal(block(src, name, s), block(dst, name, d)), (name, s, d)


def recv(d: TransferWorker, spec: RecvSpec) -> None:
    d.bind(PdTransferMetadata(recv=[spec]))
    d.start_load_kv()


KEY, OTHER_KEY = bytes(range(32)), bytes(range(1, 33))
#: The prompt hash the WRITE tests' prefill and decode requests share (unless one says not).
PROMPT_HASH = prompt_hash(range(40), 40)


@pytest.mark.parametrize(
    "pair",
    [{}, {"shape": "kv-first"}, {"key": KEY}],
    indirect=True,
    ids=["cpu", "kv-first", "fleet key"],
)
def test_read_mode_copies_blocks_and_frees_prefill(pair):
    p, pc, d, dc, port = pair
    p.bind(PdTransferMetadata(send=[SendSpec("p-req", "read", ((1, 2, 3),))]))
    assert p.get_finished({"p-req"}) == (None, None)  # held for the decode side
    pairs = ((5, 1), (9, 2), (6, 3))
    ref = RemoteRef(p.engine_id, "127.0.0.1", port, "p-req")
    recv(d, RecvSpec("d-req", "read", ref, (pairs,), ((5, 9, 6),)))
    done = poll(lambda: d.get_finished(set())[1], "the load")
    assert done == {"d-req"}
    assert d.get_block_ids_with_load_errors() == set()
    assert_copied(pc, dc, [(r, loc) for loc, r in pairs])
    assert torch.count_nonzero(block(dc, next(iter(dc)), 0)) == 0  # nothing else written
    sending = poll(lambda: p.get_finished(set())[0], "the prefill side's release")
    assert sending == {"p-req"}
    stats = d.stats.take().data
    per_block = BLOCK * HEADS * 2 * HEAD * 4
    assert stats["bytes"] == [3 * LAYERS * per_block] and stats["failures"] == 0


def test_lease_expires_without_renewal(pair):
    p, *_ = pair
    p.bind(PdTransferMetadata(send=[SendSpec("p-req", "read", ((1, 2),))]))
    assert p.get_finished({"p-req"}) == (None, None)
    assert p.stats.take().data["blocks_held"] == 2
    p.clock.now += p.cfg.lease_s - 1
    assert p.get_finished(set()) == (None, None)
    p.clock.now += 2
    assert p.get_finished(set()) == ({"p-req"}, None)
    assert p.stats.take().data["lease_expiries"] == 1


def test_renewal_extends_the_lease(pair):
    p, _, d, _, port = pair
    p.bind(PdTransferMetadata(send=[SendSpec("p-req", "read", ((1,),))]))
    p.get_finished({"p-req"})
    p.clock.now += 0.8 * p.cfg.lease_s
    d.bind(PdTransferMetadata(renew=[RemoteRef(p.engine_id, "127.0.0.1", port, "p-req")]))
    d.start_load_kv()
    renewed_until = p.clock.now + p.cfg.lease_s

    def renewed():
        p.get_finished(set())
        return p._leases._expiry.get("p-req", 0) >= renewed_until

    poll(renewed, "the renewal")
    p.clock.now += 0.5 * p.cfg.lease_s  # past the first lease, inside the renewed one
    assert p.get_finished(set()) == (None, None)
    p.clock.now += p.cfg.lease_s
    assert p.get_finished(set()) == ({"p-req"}, None)


def test_release_frees_prefill_blocks(pair):
    p, _, d, _, port = pair
    p.bind(PdTransferMetadata(send=[SendSpec("p-req", "read", ((1,),))]))
    p.get_finished({"p-req"})
    d.bind(PdTransferMetadata(release=[RemoteRef(p.engine_id, "127.0.0.1", port, "p-req")]))
    d.start_load_kv()
    sending = poll(lambda: p.get_finished(set())[0], "the release")
    assert sending == {"p-req"}


def write_offer(d, port, transfer_id, pairs, prompt=PROMPT_HASH, engine="", tp_size=None):
    """Offer decode blocks ``pairs`` (block, prompt position) for ``transfer_id``, for a
    request whose prompt hashes to ``prompt``, to the prefill ``engine`` (if named; of TP
    size ``tp_size``, if the params name one)."""
    ref = RemoteRef(engine, "127.0.0.1", port, None, tp_size=tp_size)
    local = tuple(loc for loc, _ in pairs)
    spec = RecvSpec(
        "d-req", "write", ref, (pairs,), (local,), transfer_id=transfer_id, prompt_hash=prompt
    )
    recv(d, spec)


@pytest.mark.parametrize("pair", [{}, {"key": KEY}], indirect=True, ids=["no key", "fleet key"])
@pytest.mark.parametrize("layerwise", [True, False])
def test_write_mode_pushes_into_decode_blocks(pair, layerwise):
    p, pc, d, dc, port = pair
    p.bind(PdTransferMetadata(push=[PushSpec("p-req", "t-1", ((1, 2, 3),), PROMPT_HASH)]))
    if layerwise:  # the offer arrives before the prefill step saves its layers
        write_offer(d, port, "t-1", ((4, 0), (8, 1), (10, 2)))
        poll(lambda: "t-1" in p._targets, "the decode offer")
        for layer in pc:
            p.save_kv_layer(layer)
        assert len(p._pushes["p-req"].views_done) == LAYERS
        p.wait_for_save()
    else:  # the prefill step ends first; the push waits for the offer
        for layer in pc:
            p.save_kv_layer(layer)
        p.wait_for_save()
        write_offer(d, port, "t-1", ((4, 0), (8, 1), (10, 2)))
    p.bind(PdTransferMetadata(send=[SendSpec("p-req", "write", ((1, 2, 3),), "t-1")]))
    done = poll(lambda: d.get_finished(set())[1], "the push")
    assert done == {"d-req"} and d.get_block_ids_with_load_errors() == set()
    assert_copied(pc, dc, [(1, 4), (2, 8), (3, 10)])
    sending = poll(lambda: p.get_finished({"p-req"})[0], "the prefill side's free")
    assert sending == {"p-req"}


@pytest.mark.parametrize("mode", ["read", "write"])
def test_under_tp_each_decode_rank_loads_from_the_prefill_rank_of_its_index(backend, mode):
    """Two ranks a side, each rank's cache with its own bytes (its own heads): decode rank r
    reaches prefill rank r at side_channel_port + r and loads that rank's blocks, connecting
    to no other prefill rank (a WRITE learns the prefill's TP size from rank 0's handshake
    without a connection); each prefill rank reports the request finished sending once its
    own peer is done (vLLM completes the request when every rank has)."""
    port = free_port()  # prefill rank 1 listens on port + 1
    ps = [worker("kv_producer", port, backend=backend, tp_size=2, tp_rank=r) for r in (0, 1)]
    ds = [worker("kv_consumer", free_port(), backend=backend, tp_size=2, tp_rank=r) for r in (0, 1)]
    pcs, dcs = [caches(True) for _ in ps], [caches(False) for _ in ds]
    try:
        for w, c in zip(ps + ds, pcs + dcs, strict=True):
            w.register_kv_caches(c)
        assert [p.side_port for p in ps] == [port, port + 1]
        pairs = ((5, 1), (9, 2))
        if mode == "read":
            for p in ps:
                p.bind(PdTransferMetadata(send=[SendSpec("p-req", "read", ((1, 2),))]))
                assert p.get_finished({"p-req"}) == (None, None)  # held
            ref = RemoteRef(ps[0].engine_id, "127.0.0.1", port, "p-req")
            for d in ds:
                recv(d, RecvSpec("d-req", "read", ref, (pairs,), ((5, 9),)))
        else:
            for p in ps:
                p.bind(PdTransferMetadata(push=[PushSpec("p-req", "t-tp", ((1, 2),), PROMPT_HASH)]))
                p.wait_for_save()
            for d in ds:
                write_offer(d, port, "t-tp", tuple((loc, r - 1) for loc, r in pairs))
            for p in ps:
                p.bind(PdTransferMetadata(send=[SendSpec("p-req", "write", ((1, 2),), "t-tp")]))
        for d in ds:
            assert poll(lambda d=d: d.get_finished(set())[1], "a rank's load") == {"d-req"}
            assert d.get_block_ids_with_load_errors() == set()
        for pc, dc in zip(pcs, dcs, strict=True):
            assert_copied(pc, dc, [(r, loc) for loc, r in pairs])
        layer = next(iter(dcs[0]))
        assert not torch.equal(block(dcs[0], layer, 5), block(dcs[1], layer, 5))  # per rank
        for r, d in enumerate(ds):
            assert [peer.rank for peer in d._peers.values()] == [r]  # connected to its own
        for p in ps:
            sending = poll(lambda p=p: p.get_finished({"p-req"})[0], "a rank's release")
            assert sending == {"p-req"}
    finally:
        for w in ds + ps:
            w.shutdown()


def engine_ranks(role: str, port: int, backend: str, tp_size: int, heads: int, **cfg) -> list:
    """One engine's workers, a rank each (side channel ``port`` + rank), of a model with
    ``heads`` KV heads split evenly among them (``cfg``: their connector config)."""
    return [
        worker(
            role, port, backend=backend, tp_size=tp_size, tp_rank=r, heads=heads // tp_size, **cfg
        )
        for r in range(tp_size)
    ]


@contextlib.contextmanager
def tp_engines(
    backend: str, port: int, prefill_tp: int, decode_tp: int, heads: int, decode_cfg=None
):
    """A prefill engine (side channel ``port``) and a decode engine of those TP sizes, each
    rank with its caches registered (its share of ``heads``): (prefill ranks, decode ranks,
    their caches); every rank shut down at the end. ``decode_cfg``: the decode's connector
    config."""
    ps = engine_ranks("kv_producer", port, backend, tp_size=prefill_tp, heads=heads)
    ds = engine_ranks(
        "kv_consumer", free_port(), backend, tp_size=decode_tp, heads=heads, **(decode_cfg or {})
    )
    pcs = [caches(True, heads=heads // prefill_tp) for _ in ps]
    dcs = [caches(False, heads=heads // decode_tp) for _ in ds]
    try:
        for w, c in zip(ps + ds, pcs + dcs, strict=True):
            w.register_kv_caches(c)
        yield ps, ds, pcs, dcs
    finally:
        for w in ds + ps:
            w.shutdown()


def test_a_release_reaches_every_prefill_rank_a_decode_rank_of_a_smaller_tp_reads(backend):
    """A TP 1 decode engine's request ends before it loads from a TP 2 prefill engine: its
    "done" goes to both prefill ranks (each holds the blocks of its own heads), and both free
    them at once, without waiting for their leases."""
    port = free_port()
    ps = engine_ranks("kv_producer", port, backend, tp_size=2, heads=2)
    d = worker("kv_consumer", free_port(), backend=backend, heads=2)
    try:
        for w, heads in ((ps[0], 1), (ps[1], 1), (d, 2)):
            w.register_kv_caches(caches(w.is_producer, heads=heads))
        for p in ps:
            p.bind(PdTransferMetadata(send=[SendSpec("p-req", "read", ((1, 2),))]))
            assert p.get_finished({"p-req"}) == (None, None)  # held
        ref = RemoteRef(ps[0].engine_id, "127.0.0.1", port, "p-req", tp_size=2)
        d.bind(PdTransferMetadata(release=[ref]))
        d.start_load_kv()
        for p in ps:
            sending = poll(lambda p=p: p.get_finished(set())[0], "a rank's release")
            assert sending == {"p-req"}
    finally:
        for w in [d, *ps]:
            w.shutdown()


def test_write_mode_prefill_that_lost_its_blocks_reports_failure(pair):
    p, _pc, d, _, port = pair
    p.bind(PdTransferMetadata(push=[PushSpec("p-req", "t-2", ((1, 2),), PROMPT_HASH)]))
    write_offer(d, port, "t-2", ((4, 0), (8, 1)))
    p.wait_for_save()
    p.bind(PdTransferMetadata())
    p.get_finished({"p-req"})  # finished but never confirmed as held (e.g. aborted)
    done = poll(lambda: d.get_finished(set())[1], "the failure")
    assert done == {"d-req"}
    assert d.get_block_ids_with_load_errors() == {4, 8}


def test_kv_written_for_another_prompt_is_refused(pair, caplog):
    """The prefill computed one prompt for a transfer, the decode request that offered its
    blocks holds another: each such load is refused (its blocks reported as load errors, so
    vLLM recomputes them), counted with the refused params (not as a transfer failure), and
    logged once while refusals keep coming."""
    p, pc, d, _dc, port = pair
    caplog.set_level("WARNING", logger="vllm_pd_ext.connectors.common.worker")
    other = prompt_hash(range(1, 41), 40)
    for tid in ("t-a", "t-b"):
        p.bind(PdTransferMetadata(push=[PushSpec("p-req", tid, ((1, 2),), PROMPT_HASH)]))
        write_offer(d, port, tid, ((4, 0), (8, 1)), prompt=other)
        for layer in pc:
            p.save_kv_layer(layer)
        p.wait_for_save()
        p.bind(PdTransferMetadata(send=[SendSpec("p-req", "write", ((1, 2),), tid)]))
        assert poll(lambda: d.get_finished(set())[1], "the refused load") == {"d-req"}
        assert d.get_block_ids_with_load_errors() == {4, 8}
        assert poll(lambda: p.get_finished({"p-req"})[0], "the push's end") == {"p-req"}
    stats = d.stats.take().data
    assert stats["params_refused"] == 2 and stats["failures"] == 0 and stats["bytes"] == []
    refusals = [r for r in caplog.records if "refused the KV written" in r.getMessage()]
    assert len(refusals) == 1, caplog.text
    assert "computed for another prompt" in refusals[0].getMessage()
    assert "t-a" not in d._written and "t-b" not in d._written


#: Blocks of the real schedulers' KV cache (sched_harness), for workers that serve them.
SCHED_BLOCKS = 64


@pytest.mark.parametrize("same_prompt", [True, False], ids=["same prompt", "another prompt"])
def test_write_params_replayed_with_another_prompt_recompute(tiny_qwen, backend, same_prompt):
    """Real schedulers plan both sides and real workers move the KV. The prefill engine runs
    prompt A for a transfer; the decode engine gets that transfer's WRITE params with prompt
    A (it loads all but the last token) or with prompt B (the KV written is refused, and
    vLLM's scheduler recomputes B's whole prompt)."""
    n = 40
    prompt_a = [7 + i % 50 for i in range(n)]
    prompt_b = prompt_a if same_prompt else [60 + i % 50 for i in range(n)]
    port = free_port()
    p_sched = make_scheduler(make_vllm_config(tiny_qwen, "kv_producer"))
    d_sched = make_scheduler(make_vllm_config(tiny_qwen, "kv_consumer"))
    p = worker("kv_producer", port, backend=backend, num_blocks=SCHED_BLOCKS)
    d = worker("kv_consumer", free_port(), backend=backend, num_blocks=SCHED_BLOCKS)
    pc, dc = caches(True, num_blocks=SCHED_BLOCKS), caches(False, num_blocks=SCHED_BLOCKS)
    p.register_kv_caches(pc)
    d.register_kv_caches(dc)
    try:
        tid = "t-replayed"
        leg = PrefillLeg(transfer_mode=WRITE, transfer_id=tid).params()
        p_req = make_request(n, leg, max_tokens=1, prompt=list(prompt_a))
        p_sched.add_request(p_req)
        p_meta = step(p_sched)[0].kv_connector_metadata
        params = PdExtWriteDecode.build(tid, None, "127.0.0.1", port).signed(None)
        d_req = make_request(n, params, max_tokens=2, prompt=list(prompt_b))
        d_sched.add_request(d_req)
        d_meta = step(d_sched)[0].kv_connector_metadata
        (spec,) = d_meta.recv
        d.bind(d_meta)
        d.start_load_kv()
        p.bind(p_meta)
        for layer in pc:
            p.save_kv_layer(layer)
        p.wait_for_save()
        p.bind(step(p_sched)[0].kv_connector_metadata)  # the finished request keeps its blocks
        loaded = poll(lambda: d.get_finished(set())[1], "the load")
        assert loaded == {d_req.request_id}
        errors = d.get_block_ids_with_load_errors()
        step(d_sched, recving=loaded, invalid=errors)
        out, _ = step(d_sched)
        taken = d.stats.take()
        assert taken is not None
        refused = taken.data["params_refused"]
        if same_prompt:
            assert errors == set() and refused == 0
            ours, theirs = p_meta.push[0].block_ids[0], spec.local_block_ids[0]
            assert_copied(pc, dc, list(zip(ours, theirs, strict=True)))
            assert out.num_scheduled_tokens[d_req.request_id] == 1  # only the last token
        else:
            assert errors == set(spec.local_block_ids[0]) and refused == 1
            assert out.num_scheduled_tokens[d_req.request_id] == n  # the whole prompt again
    finally:
        d.shutdown()
        p.shutdown()


@pytest.mark.parametrize("pair", [{"dcache": {"heads": 4}}], indirect=True)
def test_layout_mismatch_fails_closed(pair):
    p, _, d, dc, port = pair
    p.bind(PdTransferMetadata(send=[SendSpec("p-req", "read", ((1,),))]))
    recv(
        d,
        RecvSpec(
            "d-req",
            "read",
            RemoteRef(p.engine_id, "127.0.0.1", port, "p-req"),
            (((5, 1),),),
            ((5,),),
        ),
    )
    done = poll(lambda: d.get_finished(set())[1], "the failed load")
    assert done == {"d-req"}
    assert d.get_block_ids_with_load_errors() == {5}
    assert torch.count_nonzero(block(dc, next(iter(dc)), 5)) == 0
    assert d.stats.take().data["failures"] == 1


@pytest.mark.parametrize(
    ("pair", "refusal"),
    [
        (
            {"shape": "kv-first", "p": {"tp_size": 2}, "d": {"heads": 4}, "dcache": {"heads": 4}},
            "is not head-major, so a slice of its heads is not one span per block",
        ),
        ({"p": {"tp_size": 2}}, "model kv_heads: 2 here, 4 remote"),
        (
            {
                "p": {"tp_size": 2, "heads": 1, "kv_heads": 1},
                "pcache": {"heads": 1},
                "d": {"heads": 1},
                "dcache": {"heads": 1},
            },
            "prefill TP 2 is more than the model's 1 KV heads",
        ),
    ],
    indirect=["pair"],
    ids=["token-major layout", "other heads", "more ranks than heads"],
)
def test_a_read_between_tp_sizes_that_cannot_split_heads_is_refused_at_handshake(
    pair, refusal, caplog
):
    """READ from a prefill of TP 2 into a decode of TP 1 where a head slice is not
    addressable (heads inside each token), the two sides disagree on the model's heads, or the
    prefill has more ranks than heads: refused at the handshake with prefill rank 0, nothing
    copied, the load fails (recomputed)."""
    p, _, d, dc, port = pair
    caplog.set_level("WARNING", logger="vllm_pd_ext.connectors.common.worker")
    p.bind(PdTransferMetadata(send=[SendSpec("p-req", "read", ((1,),))]))
    ref = RemoteRef(p.engine_id, "127.0.0.1", port, "p-req", tp_size=2)
    recv(d, RecvSpec("d-req", "read", ref, (((5, 1),),), ((5,),)))
    assert poll(lambda: d.get_finished(set())[1], "the refused load") == {"d-req"}
    assert d.get_block_ids_with_load_errors() == {5}
    assert torch.count_nonzero(block(dc, next(iter(dc)), 5)) == 0
    assert refusal in caplog.text, caplog.text


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
def test_read_between_tp_sizes_moves_each_decode_ranks_heads(backend, prefill_tp, decode_tp):
    """Four KV heads, prefill TP 2 -> decode TP 1 (the decode rank reads both prefill ranks'
    heads into its blocks) and TP 1 -> TP 2 (each decode rank reads its half of the prefill
    rank's heads). Every decode block equals the model's heads it holds; a prefill rank frees
    the request only once every decode rank that reads it said done."""
    heads = 4
    port = free_port()
    with tp_engines(backend, port, prefill_tp, decode_tp, heads) as (ps, ds, pcs, dcs):
        for p in ps:
            p.bind(PdTransferMetadata(send=[SendSpec("p-req", "read", ((1, 2),))]))
            assert p.get_finished({"p-req"}) == (None, None)  # held
        pairs = ((5, 1), (9, 2))
        ref = RemoteRef(ps[0].engine_id, "127.0.0.1", port, "p-req", tp_size=prefill_tp)
        for i, d in enumerate(ds):
            recv(d, RecvSpec("d-req", "read", ref, (pairs,), ((5, 9),)))
            assert poll(lambda d=d: d.get_finished(set())[1], "a rank's load") == {"d-req"}
            assert d.get_block_ids_with_load_errors() == set()
            if i + 1 < len(ds):  # another decode rank still reads the prefill's heads
                assert ps[0].get_finished(set()) == (None, None)
                assert "p-req" in ps[0]._held
        per_d = heads // decode_tp
        for q, dc in enumerate(dcs):
            for name in dc:
                for loc, r in pairs:
                    model = torch.cat([block(pc, name, r) for pc in pcs])  # all heads
                    assert torch.equal(block(dc, name, loc), model[q * per_d : (q + 1) * per_d])
            assert torch.count_nonzero(block(dc, next(iter(dc)), 1)) == 0  # nothing else
            stats = ds[q].stats.take()
            assert stats is not None
            assert stats.data["bytes"] == [2 * LAYERS * per_d * BLOCK * 2 * HEAD * 4]
        for p in ps:
            sending = poll(lambda p=p: p.get_finished({"p-req"})[0], "a rank's release")
            assert sending == {"p-req"}


def test_a_decode_rank_that_fails_before_its_claim_closes_its_lease_slot(backend):
    """Prefill TP 1, decode TP 2: decode rank 0 claims and reads its half of the heads; rank
    1 had handshaken, but its ``/renew`` finds the prefill's side channel gone, so it never
    claims its slot. Its load fails, and its "done" notice (naming its engine and rank) closes
    that slot: the prefill frees the blocks at once, and no lease expiry is counted."""
    heads = 4
    port, dport = free_port(), free_port()
    (p,) = engine_ranks("kv_producer", port, backend, tp_size=1, heads=heads)
    ds = engine_ranks("kv_consumer", dport, backend, tp_size=2, heads=heads)
    try:
        p.register_kv_caches(caches(True, heads=heads))
        for d in ds:
            d.register_kv_caches(caches(False, heads=heads // 2))
        p.bind(PdTransferMetadata(send=[SendSpec("p-req", "read", ((1, 2),))]))
        assert p.get_finished({"p-req"}) == (None, None)  # held
        ref = RemoteRef(p.engine_id, "127.0.0.1", port, "p-req", tp_size=1)
        ds[1]._peer(ref, 0)  # rank 1 handshook, as it does on its first load from p
        pairs = ((5, 1), (9, 2))
        recv(ds[0], RecvSpec("d-req", "read", ref, (pairs,), ((5, 9),)))
        assert poll(lambda: ds[0].get_finished(set())[1], "rank 0's load") == {"d-req"}
        assert ds[0].get_block_ids_with_load_errors() == set()
        assert p.get_finished(set()) == (None, None)  # rank 1's slot is still open
        assert p._server is not None
        p._server.close()  # rank 1's /renew cannot reach the prefill any more
        recv(ds[1], RecvSpec("d-req", "read", ref, (pairs,), ((5, 9),)))
        assert poll(lambda: ds[1].get_finished(set())[1], "rank 1's load") == {"d-req"}
        assert ds[1].get_block_ids_with_load_errors() == {5, 9}
        sending = poll(lambda: p.get_finished(set())[0], "the release of the closed slot")
        assert sending == {"p-req"} and "p-req" not in p._held
        assert p.stats.take().data["lease_expiries"] == 0
    finally:
        for w in [*ds, p]:
            w.shutdown()


def test_a_done_that_closes_an_unclaimed_slot_gives_its_sender_no_claim(backend):
    """Prefill TP 1, decode TP 2: rank 0 claims the lease; rank 1's request ends before it
    claims, and its "done" closes its slot. The slot is closed, not held by rank 1: a later
    ``/renew`` from rank 1 is refused, and the lease's holder is still rank 0 alone."""
    port = free_port()
    with tp_engines(backend, port, 1, 2, heads=4) as ((p,), ds, _, _):
        p.bind(PdTransferMetadata(send=[SendSpec("p-req", "read", ((1, 2),))]))
        assert p.get_finished({"p-req"}) == (None, None)  # held
        engines = []
        for d in ds:
            assert d.transport is not None
            engines.append(d.transport.engine_id)

        def claim(q: int) -> None:
            body = {"req": "p-req", "engine_id": engines[q], "decode_engine": ds[q].engine_id}
            post_json("127.0.0.1", port, "/renew", {**body, "tp_size": 2, "tp_rank": q}, 5.0)

        claim(0)
        ref = RemoteRef(p.engine_id, "127.0.0.1", port, "p-req", tp_size=1)
        ds[1].bind(PdTransferMetadata(release=[ref]))
        ds[1].start_load_kv()

        def closed() -> bool:
            p.get_finished(set())
            return not p._leases.unclaimed("p-req", (ds[1].engine_id, 1))

        poll(closed, "rank 1's done")
        assert "p-req" in p._held  # rank 0 still reads
        with pytest.raises(SideChannelError, match="closed unread"):
            claim(1)
        assert p._leases.holders("p-req") == {engines[0]}


@pytest.mark.parametrize("layerwise", [True, False])
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
def test_write_between_tp_sizes_puts_each_prefill_ranks_heads_in_place(
    backend, prefill_tp, decode_tp, layerwise
):
    """Four KV heads, WRITE, prefill TP 2 -> decode TP 1 (both prefill ranks write their heads
    into their place in the decode rank's blocks) and TP 1 -> TP 2 (the prefill rank writes
    each decode rank its half): every decode rank offers its blocks to each prefill rank
    holding heads of its own and loads once each of them said written; every decode block
    equals the model's heads it holds, nothing else is written, every prefill rank frees."""
    heads = 4
    port = free_port()
    with tp_engines(backend, port, prefill_tp, decode_tp, heads) as (ps, ds, pcs, dcs):
        for p in ps:
            p.bind(PdTransferMetadata(push=[PushSpec("p-req", "t-x", ((1, 2),), PROMPT_HASH)]))
        offered = ((5, 0), (9, 1))  # (decode block, prompt block position)
        if layerwise:  # every offer is there before the prefill step saves its layers
            for d in ds:
                write_offer(d, port, "t-x", offered)
            want = len(ps[0]._writes_to(decode_tp))
            for p in ps:
                poll(lambda p=p: len(p._offers("t-x")) == want, "the decode offers")
        for p, pc in zip(ps, pcs, strict=True):
            for layer in pc:
                p.save_kv_layer(layer)
            p.wait_for_save()
        if not layerwise:  # the prefill step ended first: each push waits for its offers
            for d in ds:
                write_offer(d, port, "t-x", offered)
        for p in ps:
            p.bind(PdTransferMetadata(send=[SendSpec("p-req", "write", ((1, 2),), "t-x")]))
        for d in ds:
            assert poll(lambda d=d: d.get_finished(set())[1], "a rank's load") == {"d-req"}
            assert d.get_block_ids_with_load_errors() == set()
        per_d = heads // decode_tp
        for q, dc in enumerate(dcs):
            for name in dc:
                for loc, r in ((5, 1), (9, 2)):
                    model = torch.cat([block(pc, name, r) for pc in pcs])  # all heads
                    assert torch.equal(block(dc, name, loc), model[q * per_d : (q + 1) * per_d])
            assert torch.count_nonzero(block(dc, next(iter(dc)), 1)) == 0  # nothing else
        for p in ps:
            sending = poll(lambda p=p: p.get_finished({"p-req"})[0], "a rank's free")
            assert sending == {"p-req"}


@pytest.mark.parametrize(
    "when", ["waiting for offers", "mid push", "before its offer", "after the push ended"]
)
def test_a_cancel_from_one_decode_rank_fails_the_others_loads_at_once(backend, when):
    """Prefill TP 1 writes into both ranks of a TP 2 decode engine; decode rank 0 cancels
    the transfer (its load failed: in the middle of the layer pushes, its own load timed out)
    while the push waits for the offers (rank 1's is in), mid push, before rank 1 offered,
    or so that the push has ended (and been collected) before rank 1's offer comes.
    Rank 1 fails its load at once (told by the prefill, or its offer refused), not at its
    transfer timeout; nothing more is written into its blocks; the prefill counts no lease
    expiry."""
    port = free_port()
    slow = {"transfer_timeout_s": 60.0}  # beyond every poll below: only a notice ends it early
    with tp_engines(backend, port, 1, 2, heads=4, decode_cfg=slow) as ((p,), ds, (pc,), dcs):
        p.bind(PdTransferMetadata(push=[PushSpec("p-req", "t-c", ((1, 2),), PROMPT_HASH)]))
        ref = RemoteRef(p.engine_id, "127.0.0.1", port, None)
        layers = list(pc)

        def push_ended() -> bool:
            p.get_finished(set())
            return not p._push_futures

        if when == "waiting for offers":
            p.wait_for_save()  # the push waits for both ranks' offers
            write_offer(ds[1], port, "t-c", ((5, 0), (9, 1)))
            poll(lambda: p._offers("t-c"), "rank 1's offer")
            ds[0]._cancel_writes(ref, [0], "t-c")
        elif when == "mid push":
            ds[0].cfg = ds[0].cfg.model_copy(update={"transfer_timeout_s": 0.5})
            for d in ds:
                write_offer(d, port, "t-c", ((5, 0), (9, 1)))
            poll(lambda: len(p._offers("t-c")) == 2, "both offers")
            p.save_kv_layer(layers[0])  # the first layer goes to both ranks
            assert poll(lambda: ds[0].get_finished(set())[1], "rank 0's timeout") == {"d-req"}
            assert ds[0].get_block_ids_with_load_errors() == {5, 9}  # it cancelled
        elif when == "before its offer":
            ds[0]._cancel_writes(ref, [0], "t-c")
            write_offer(ds[1], port, "t-c", ((5, 0), (9, 1)))
        else:
            p.wait_for_save()
            ds[0]._cancel_writes(ref, [0], "t-c")
            poll(push_ended, "the push's end")  # collected: get_finished forgot it
            write_offer(ds[1], port, "t-c", ((5, 0), (9, 1)))
        assert poll(lambda: ds[1].get_finished(set())[1], "rank 1's load") == {"d-req"}
        assert ds[1].get_block_ids_with_load_errors() == {5, 9}
        for layer in layers[1:]:
            p.save_kv_layer(layer)
        p.wait_for_save()
        poll(push_ended, "the push's end")
        assert p.stats.take().data["lease_expiries"] == 0
        for name in layers[1:]:  # written after the cancel: nothing
            assert torch.count_nonzero(block(dcs[1], name, 5)) == 0


@pytest.mark.parametrize("named", [2, 1], ids=["its TP size", "another TP size"])
def test_write_params_naming_the_prefill_tp_size_are_taken_when_it_is_true(backend, named):
    """WRITE params that name the prefill's TP size (2, decode TP 1): named right, the
    decode rank offers to both prefill ranks and loads both halves of the heads; named
    wrong (1), the prefill rank's handshake says otherwise and the load fails before any
    offer."""
    heads = 4
    port = free_port()
    with tp_engines(backend, port, 2, 1, heads) as (ps, (d,), pcs, (dc,)):
        if named == 2:
            for p in ps:
                spec = PushSpec("p-req", "t-n", ((1, 2),), PROMPT_HASH)
                p.bind(PdTransferMetadata(push=[spec]))
                p.wait_for_save()
        write_offer(d, port, "t-n", ((5, 0), (9, 1)), tp_size=named)
        if named == 2:
            for p in ps:
                p.bind(PdTransferMetadata(send=[SendSpec("p-req", "write", ((1, 2),), "t-n")]))
        assert poll(lambda: d.get_finished(set())[1], "the load") == {"d-req"}
        for name in dc:
            model = torch.cat([block(pc, name, 1) for pc in pcs])  # all heads of block 1
            if named == 2:
                assert torch.equal(block(dc, name, 5), model)
            else:
                assert torch.count_nonzero(block(dc, name, 5)) == 0
        assert d.get_block_ids_with_load_errors() == (set() if named == 2 else {5, 9})


@pytest.mark.parametrize("pair", [{"p": {"tp_size": 2}}], indirect=True)
def test_a_write_offer_from_a_decode_rank_holding_none_of_our_heads_is_refused(pair):
    """Prefill rank 0 of TP 2 holds heads 0 and 1 of the model's four; an offer from decode
    rank 2 of TP 4, which holds head 2 only, is refused before anything is written."""
    p, _, d, _, port = pair
    offer = offer_of(d, "t-no", tp_size=4, tp_rank=2)
    with pytest.raises(SideChannelError, match="decode TP rank 2 of 4 holds no head of ours"):
        post_json("127.0.0.1", port, "/write_target", offer, 5.0)
    assert "t-no" not in p._targets


@pytest.mark.parametrize("pairs", [[[[5, -1]]], [[[-5, 0]]]])
def test_a_write_offer_naming_a_negative_block_or_position_is_refused(pair, pairs):
    """A prompt position of -1 would take our last block of the request (Python's index from
    the end), a negative block id no block of the decode's: refused before anything is kept."""
    p, _, d, _, port = pair
    offer = offer_of(d, "t-neg", pairs=pairs)
    with pytest.raises(SideChannelError, match="not negative"):
        post_json("127.0.0.1", port, "/write_target", offer, 5.0)
    assert "t-neg" not in p._targets


def test_a_write_offer_one_prefill_rank_cannot_take_is_withdrawn_from_the_others(backend):
    """Decode TP 1 offers its blocks to both ranks of a TP 2 prefill engine; rank 1 is gone
    when the second transfer's offers go out (rank 0 has its offer already): the load fails,
    and rank 0's offer is withdrawn before our blocks go back to vLLM, so rank 0's later
    layer pushes write nothing into them."""
    heads = 4
    port = free_port()
    with tp_engines(backend, port, 2, 1, heads) as (ps, (d,), pcs, (dc,)):
        # a first WRITE: the decode rank knows both prefill ranks (handshakes done)
        for p in ps:
            p.bind(PdTransferMetadata(push=[PushSpec("p-req", "t-1", ((1, 2),), PROMPT_HASH)]))
            p.wait_for_save()
        write_offer(d, port, "t-1", ((5, 0), (9, 1)))
        for p in ps:
            p.bind(PdTransferMetadata(send=[SendSpec("p-req", "write", ((1, 2),), "t-1")]))
        assert poll(lambda: d.get_finished(set())[1], "the first load") == {"d-req"}
        assert d.get_block_ids_with_load_errors() == set()
        ps[1].shutdown()  # its side channel closed: an offer to it fails
        ps[0].bind(PdTransferMetadata(push=[PushSpec("p-2", "t-2", ((1, 2),), PROMPT_HASH)]))
        write_offer(d, port, "t-2", ((6, 0), (10, 1)))
        assert poll(lambda: d.get_finished(set())[1], "the failed load") == {"d-req"}
        assert d.get_block_ids_with_load_errors() == {6, 10}
        assert ps[0]._offers("t-2") == []  # withdrawn
        for layer in pcs[0]:
            ps[0].save_kv_layer(layer)
        ps[0].wait_for_save()
        for name in dc:
            for loc in (6, 10):
                assert torch.count_nonzero(block(dc, name, loc)) == 0


@pytest.mark.parametrize("pair", [{}], indirect=True)
def test_a_cancel_racing_a_layer_push_does_not_raise_into_the_forward_pass(pair):
    """The decode side cancels a WRITE while the prefill's forward pass pushes its layers
    (the push took its offers just before the cancel withdrew them): save_kv_layer writes
    nothing more and raises nothing into vLLM's forward pass."""
    p, pc, d, _, port = pair
    p.bind(PdTransferMetadata(push=[PushSpec("p-req", "t-c", ((1, 2),), PROMPT_HASH)]))
    write_offer(d, port, "t-c", ((4, 0), (8, 1)))
    offers = poll(lambda: p._offers("t-c"), "the decode offer")
    p._on_cancel({"transfer_id": "t-c"})  # as the side channel's thread runs it
    p._offers = lambda tid: offers  # the snapshot the layer push took before the cancel
    for layer in pc:
        p.save_kv_layer(layer)
    assert p._pushes["p-req"].views_done == set()


class LockedOnly(dict):
    """A dict that records every change made while ``lock`` is not held."""

    def __init__(self, lock) -> None:
        super().__init__()
        self.lock = lock
        self.unlocked: list[str] = []

    def _check(self, what: str) -> None:
        if not self.lock.locked():
            self.unlocked.append(what)

    def setdefault(self, key, default=None):
        self._check(f"setdefault {key}")
        return super().setdefault(key, default)

    def pop(self, key, *default):
        self._check(f"pop {key}")
        return super().pop(key, *default)

    def __setitem__(self, key, value) -> None:
        self._check(f"set {key}")
        super().__setitem__(key, value)

    def __delitem__(self, key) -> None:
        self._check(f"del {key}")
        super().__delitem__(key)


@pytest.mark.parametrize("backend", ["tcp"])
def test_read_grants_change_only_under_the_lease_lock(pair):
    """The side channel adds a lease's read grants (``/renew``) while the worker thread frees
    them (a done, an expiry): every change to the table happens under the lease lock, on
    both paths."""
    p, _, d, _, port = pair
    grants = p._read_grants = LockedOnly(p._lease_lock)
    p.bind(PdTransferMetadata(send=[SendSpec(r, "read", ((b,),)) for r, b in (("a", 1), ("b", 2))]))
    p.get_finished({"a", "b"})
    recv(
        d,
        RecvSpec(
            "d-a", "read", RemoteRef(p.engine_id, "127.0.0.1", port, "a"), (((5, 1),),), ((5,),)
        ),
    )
    assert poll(lambda: d.get_finished(set())[1], "the load") == {"d-a"}
    assert poll(lambda: p.get_finished(set())[0], "the release") == {"a"}
    assert d.transport is not None  # b: claimed, then its lease runs out
    post_json("127.0.0.1", port, "/renew", {"req": "b", "engine_id": d.transport.engine_id}, 5.0)
    assert "b" in grants
    p.clock.now += p.cfg.lease_s + 1
    assert p.get_finished(set()) == ({"b"}, None)
    assert not grants and grants.unlocked == []


def offer_of(d: TransferWorker, transfer_id: str, **changes) -> dict:
    """The WRITE offer decode worker ``d`` sends for block 5 (``changes`` applied)."""
    assert d.transport is not None and d.layout is not None
    return {
        "transfer_id": transfer_id,
        "engine_id": d.engine_id,
        "transport": d.transport.descriptor().to_dict(),
        "layout": d.layout.to_dict(),
        "pairs": [[[5, 0]]],
        "v": HANDSHAKE_VERSION,
        "tp_size": d.tp_size,
        "tp_rank": d.tp_rank,
        **changes,
    }


@pytest.mark.parametrize("pair", [{"p": {"tp_size": 2}, "d": {"tp_size": 2}}], indirect=True)
def test_a_peer_of_another_tp_rank_is_refused_at_handshake(pair, caplog):
    """Both engines TP 2, but the side channel that answers is another rank's (as when the
    ports of two engines' ranks interleave): the decode rank refuses it, and the prefill rank
    refuses an offer from another rank."""
    p, _, d, dc, port = pair
    caplog.set_level("WARNING", logger="vllm_pd_ext.connectors.common.worker")
    d.tp_rank = 1  # decode rank 1 meets prefill rank 0's side channel at its own port
    d.side_port = port
    p.bind(PdTransferMetadata(send=[SendSpec("p-req", "read", ((1,),))]))
    ref = RemoteRef(p.engine_id, "127.0.0.1", port - 1, "p-req")  # port - 1 + rank 1
    recv(d, RecvSpec("d-req", "read", ref, (((5, 1),),), ((5,),)))
    assert poll(lambda: d.get_finished(set())[1], "the refused load") == {"d-req"}
    assert d.get_block_ids_with_load_errors() == {5}
    assert torch.count_nonzero(block(dc, next(iter(dc)), 5)) == 0
    assert "TP rank 1 reached a peer that is TP rank 0" in caplog.text, caplog.text
    with pytest.raises(SideChannelError, match="TP rank 0 reached a peer that is TP rank 1"):
        post_json("127.0.0.1", port, "/write_target", offer_of(d, "t-rank"), 5.0)
    assert "t-rank" not in p._targets


@pytest.mark.parametrize("pair", [{"key": KEY, "d_key": OTHER_KEY}], indirect=True)
@pytest.mark.parametrize("mode", ["read", "write"])
def test_a_decode_worker_with_another_fleet_key_loads_nothing(pair, mode):
    """The prefill side refuses its side-channel requests (counted), and the load fails (the
    scheduler then recomputes): no block is written on either side."""
    p, _, d, dc, port = pair
    if mode == "read":
        p.bind(PdTransferMetadata(send=[SendSpec("p-req", "read", ((1, 2),))]))
        p.get_finished({"p-req"})
        ref = RemoteRef(p.engine_id, "127.0.0.1", port, "p-req")
        recv(d, RecvSpec("d-req", "read", ref, (((5, 1), (9, 2)),), ((5, 9),)))
    else:
        p.bind(PdTransferMetadata(push=[PushSpec("p-req", "t-1", ((1, 2),), PROMPT_HASH)]))
        write_offer(d, port, "t-1", ((5, 0), (9, 1)))
    done = poll(lambda: d.get_finished(set())[1], "the failed load")
    assert done == {"d-req"}
    assert d.get_block_ids_with_load_errors() == {5, 9}
    assert all(torch.count_nonzero(t) == 0 for t in dc.values())
    assert p.stats.take().data["unauthenticated"] >= 1
    assert "t-1" not in p._targets


def test_unreachable_prefill_is_a_load_error(pair):
    _, _, d, _, _ = pair
    ref = RemoteRef("nobody", "127.0.0.1", free_port(), "p-req")
    recv(d, RecvSpec("d-req", "read", ref, (((3, 1), (4, 2)),), ((3, 4),)))
    done = poll(lambda: d.get_finished(set())[1], "the failed load")
    assert done == {"d-req"}
    assert d.get_block_ids_with_load_errors() == {3, 4}


def test_wrong_engine_behind_the_side_channel_is_refused(pair):
    _p, _, d, _, port = pair
    ref = RemoteRef("some-other-engine", "127.0.0.1", port, "p-req")
    recv(d, RecvSpec("d-req", "read", ref, (((3, 1),),), ((3,),)))
    poll(lambda: d.get_finished(set())[1], "the refused load")
    assert d.get_block_ids_with_load_errors() == {3}


def test_read_after_the_lease_ran_out_is_refused(pair):
    """The decode side renews synchronously before reading: blocks the prefill side already
    freed are never read."""
    p, _, d, dc, port = pair
    p.bind(PdTransferMetadata(send=[SendSpec("p-req", "read", ((1, 2),))]))
    p.get_finished({"p-req"})
    p.clock.now += p.cfg.lease_s + 1
    assert p.get_finished(set()) == ({"p-req"}, None)  # freed: may be reused any moment
    ref = RemoteRef(p.engine_id, "127.0.0.1", port, "p-req")
    spec = RecvSpec("d-req", "read", ref, (((5, 1), (6, 2)),), ((5, 6),), lease_s=30.0)
    recv(d, spec)
    assert poll(lambda: d.get_finished(set())[1], "the refused load") == {"d-req"}
    assert d.get_block_ids_with_load_errors() == {5, 6}
    assert torch.count_nonzero(block(dc, next(iter(dc)), 5)) == 0


def test_read_renews_then_reads_within_the_lease(pair):
    p, pc, d, dc, port = pair
    p.bind(PdTransferMetadata(send=[SendSpec("p-req", "read", ((1,),))]))
    p.get_finished({"p-req"})
    p.clock.now += p.cfg.lease_s - 1  # about to run out: the synchronous renewal saves it
    ref = RemoteRef(p.engine_id, "127.0.0.1", port, "p-req")
    recv(d, RecvSpec("d-req", "read", ref, (((7, 1),),), ((7,),), lease_s=p.cfg.lease_s))
    assert poll(lambda: d.get_finished(set())[1], "the load") == {"d-req"}
    assert d.get_block_ids_with_load_errors() == set()
    assert_copied(pc, dc, [(1, 7)])


def peer_rows(w: TransferWorker) -> dict[str, dict[str, float]]:
    """The per-peer stats ``w`` counted since they were last taken, without the seconds (each
    checked > 0 where a transfer was counted)."""
    taken = w.stats.take()
    assert taken is not None
    rows = {}
    for peer, row in taken.data["peers"].items():
        assert (row["seconds"] > 0) == (row["transfers"] > 0), (peer, row)
        rows[peer] = {k: v for k, v in row.items() if k != "seconds" and v}
    return rows


def test_reads_their_failures_and_lease_expiries_count_per_peer_engine(pair):
    """The decode side counts its reads and failed reads under the engine id of the prefill
    it read from (a failure before any handshake too: the params name it); a failed read
    still says done, so the prefill frees those blocks at once; the prefill side counts an
    expired lease under the engine id of the decode that claimed its blocks, and one nobody
    claimed under "unknown"."""
    p, _, d, _, port = pair
    held = [
        SendSpec(r, "read", ((b,),))
        for r, b in (("p-ok", 1), ("p-late", 2), ("p-claimed", 3), ("p-none", 4))
    ]
    p.bind(PdTransferMetadata(send=held))
    p.get_finished({s.req_id for s in held})

    def load(req: str, ref: RemoteRef, **kw) -> None:
        recv(d, RecvSpec(req, "read", ref, (((5, 1),),), ((5,),), **kw))
        assert poll(lambda: d.get_finished(set())[1], f"the load of {req}") == {req}

    load("d-ok", RemoteRef(p.engine_id, "127.0.0.1", port, "p-ok"))
    # claims the blocks (renews), then cannot read within the lease it was given: it fails
    # and says done
    load("d-late", RemoteRef(p.engine_id, "127.0.0.1", port, "p-late"), lease_s=1e-9)
    load("d-lost", RemoteRef("engine-gone", "127.0.0.1", free_port(), "p-x"))
    assert d.transport is not None  # claims p-claimed as a read would, then goes silent
    claim = {"req": "p-claimed", "engine_id": d.transport.engine_id, "decode_engine": d.engine_id}
    post_json("127.0.0.1", port, "/renew", claim, 5.0)
    per_block = BLOCK * HEADS * 2 * HEAD * 4
    assert peer_rows(d) == {
        p.engine_id: {"transfers": 1, "bytes": LAYERS * per_block, "failures": 1},
        "engine-gone": {"failures": 1},
    }
    released: set[str] = set()

    def both_released() -> bool:
        released.update(p.get_finished(set())[0] or ())
        return released == {"p-ok", "p-late"}

    poll(both_released, "the releases")
    p.clock.now += p.cfg.lease_s + 1
    assert p.get_finished(set()) == ({"p-claimed", "p-none"}, None)
    assert peer_rows(p) == {d.engine_id: {"lease_expiries": 1}, "unknown": {"lease_expiries": 1}}


def test_pushes_and_their_failures_count_per_peer_engine(pair):
    """WRITE: the prefill side counts its pushes (bytes) and failed pushes under the engine
    id of the decode that offered its blocks; the decode side its waits (no bytes: it moved
    none) and failures under the prefill's."""
    p, _pc, d, _dc, port = pair
    p.bind(PdTransferMetadata(push=[PushSpec("p-ok", "t-ok", ((1, 2),), PROMPT_HASH)]))
    p.wait_for_save()
    write_offer(d, port, "t-ok", ((4, 0), (8, 1)), engine=p.engine_id)
    p.bind(PdTransferMetadata(send=[SendSpec("p-ok", "write", ((1, 2),), "t-ok")]))
    assert poll(lambda: d.get_finished(set())[1], "the push") == {"d-req"}
    assert poll(lambda: p.get_finished({"p-ok"})[0], "the prefill's free") == {"p-ok"}
    # a prefill request that ends without keeping its blocks: the push fails
    p.bind(PdTransferMetadata(push=[PushSpec("p-lost", "t-lost", ((1, 2),), PROMPT_HASH)]))
    write_offer(d, port, "t-lost", ((4, 0), (8, 1)), engine=p.engine_id)
    p.wait_for_save()
    p.bind(PdTransferMetadata())
    p.get_finished({"p-lost"})
    assert poll(lambda: d.get_finished(set())[1], "the failure") == {"d-req"}
    per_block = BLOCK * HEADS * 2 * HEAD * 4
    assert peer_rows(p) == {
        d.engine_id: {"transfers": 1, "bytes": 2 * LAYERS * per_block, "failures": 1}
    }
    assert peer_rows(d) == {p.engine_id: {"transfers": 1, "failures": 1}}


@pytest.mark.parametrize("pair", [{"d": {"transfer_timeout_s": 1.0}}], indirect=True)
def test_write_cancelled_by_a_decode_that_timed_out_is_never_written(pair):
    p, pc, d, dc, port = pair
    write_offer(d, port, "t-3", ((4, 0), (8, 1)))
    done = poll(lambda: d.get_finished(set())[1], "the decode side's timeout")
    assert done == {"d-req"} and d.get_block_ids_with_load_errors() == {4, 8}
    # the prefill side gets there late: it must not touch the blocks the decode side freed
    p.bind(PdTransferMetadata(push=[PushSpec("p-req", "t-3", ((1, 2),), PROMPT_HASH)]))
    for layer in pc:
        p.save_kv_layer(layer)
    p.wait_for_save()
    p.bind(PdTransferMetadata(send=[SendSpec("p-req", "write", ((1, 2),), "t-3")]))
    assert poll(lambda: p.get_finished({"p-req"})[0], "the prefill side's free") == {"p-req"}
    for layer in dc:
        assert torch.count_nonzero(block(dc, layer, 4)) == 0
        assert torch.count_nonzero(block(dc, layer, 8)) == 0


def test_a_second_offer_for_a_transfer_is_refused_and_the_first_gets_the_push(pair, backend):
    """Someone who learns a transfer id offers blocks of their own for it after the real
    decode worker did: the prefill side refuses the second offer (first writer wins), and the
    push lands in the real decode worker's blocks only."""
    p, pc, d, dc, port = pair
    thief = worker("kv_consumer", free_port(), backend=backend)
    tc = caches(False)
    thief.register_kv_caches(tc)
    try:
        p.bind(PdTransferMetadata(push=[PushSpec("p-req", "t-9", ((1, 2),), PROMPT_HASH)]))
        write_offer(d, port, "t-9", ((4, 0), (8, 1)))
        poll(lambda: "t-9" in p._targets, "the real offer")
        write_offer(thief, port, "t-9", ((4, 0), (8, 1)))
        refused = poll(lambda: thief.get_finished(set())[1], "the thief's refusal")
        assert refused == {"d-req"} and thief.get_block_ids_with_load_errors() == {4, 8}
        for layer in pc:
            p.save_kv_layer(layer)
        p.wait_for_save()
        p.bind(PdTransferMetadata(send=[SendSpec("p-req", "write", ((1, 2),), "t-9")]))
        assert poll(lambda: d.get_finished(set())[1], "the push") == {"d-req"}
        assert_copied(pc, dc, [(1, 4), (2, 8)])
        assert all(torch.count_nonzero(t) == 0 for t in tc.values())
    finally:
        thief.shutdown()


def test_a_written_notice_nobody_waits_for_is_dropped(pair, caplog):
    """'written' notices for transfers no load waits for (forged, or from nobody we asked)
    are not kept: they cannot fill the decode worker's memory or complete a later load."""
    p, _pc, d, _dc, _port = pair
    assert p.transport is not None and d.transport is not None
    peer = p.transport.connect(d.transport.descriptor())
    for i in range(50):
        p._notify(peer, {"op": "written", "transfer_id": f"forged-{i}", "ok": True})

    def dropped() -> int:
        d.get_finished(set())  # handles the notices that arrived
        return sum("ignored a 'written' notice" in r.getMessage() for r in caplog.records)

    with caplog.at_level("WARNING"):
        poll(lambda: dropped() == 50, "all 50 notices handled")
    assert d._written == {}


def third_peer(backend: str):
    """A transport of ``backend`` that is neither side of the pair (with the one region a
    Mooncake notification needs)."""
    import numpy as np

    from vllm_pd_ext.transport import get_backend

    t = get_backend(backend, host="127.0.0.1")
    buf = np.zeros(64, dtype=np.uint8)
    t.register_buffer("x", buf.ctypes.data, buf.nbytes, owner=buf)
    return t


def test_a_written_notice_from_another_peer_than_the_writer_is_ignored(pair, backend, caplog):
    """A third transport that learned a transfer id says "written" for it first: the decode
    side keeps waiting (its blocks are not used as loaded) until the prefill it asked writes."""
    import json

    p, pc, d, dc, port = pair
    assert d.transport is not None
    p.bind(PdTransferMetadata(push=[PushSpec("p-req", "t-1", ((1, 2, 3),), PROMPT_HASH)]))
    write_offer(d, port, "t-1", ((4, 0), (8, 1), (10, 2)))
    poll(lambda: "t-1" in p._targets, "the decode offer")
    evil = third_peer(backend)
    try:
        peer = evil.connect(d.transport.descriptor())
        evil.notify(peer, json.dumps({"op": "written", "transfer_id": "t-1", "ok": True}).encode())

        def ignored() -> bool:
            assert not d.get_finished(set())[1], "the forged notice completed the load"
            return any("ignored a 'written' notice for transfer t-1" in r.getMessage()
                       for r in caplog.records)  # fmt: skip

        with caplog.at_level("WARNING"):
            poll(ignored, "the forged notice to be handled")
    finally:
        evil.close()
    for layer in pc:
        p.save_kv_layer(layer)
    p.wait_for_save()
    p.bind(PdTransferMetadata(send=[SendSpec("p-req", "write", ((1, 2, 3),), "t-1")]))
    assert poll(lambda: d.get_finished(set())[1], "the push") == {"d-req"}
    assert d.get_block_ids_with_load_errors() == set()
    assert_copied(pc, dc, [(1, 4), (2, 8), (3, 10)])


def test_a_renew_naming_a_huge_or_odd_tp_size_is_refused_before_any_slot_is_made(pair):
    """A ``/renew`` is answered with the slots of every decode rank that reads us: a body
    naming a TP size beyond any real one (or not a number) is refused at once, before the
    slots (one per reading rank) are computed or kept."""
    from vllm_pd_ext.connectors.common.side_channel import SideChannelError, post_json

    p, _, d, _, port = pair
    assert d.transport is not None
    p.bind(PdTransferMetadata(send=[SendSpec("p-req", "read", ((1, 2),))]))
    assert p.get_finished({"p-req"}) == (None, None)
    for size in (10**9, "2", -1):
        body = {"req": "p-req", "engine_id": d.transport.engine_id, "tp_size": size}
        with pytest.raises(SideChannelError, match=r"is not one in 1\.\."):
            post_json("127.0.0.1", port, "/renew", {**body, "tp_rank": 0}, 2)
    assert p._leases.holder("p-req") is None  # nobody claimed the blocks


def test_leased_blocks_belong_to_the_peer_that_claimed_them(pair, backend, caplog):
    """The decode transport that renews first (right before it reads) holds the lease: another
    peer's renewal is refused, and its "done" or "renew" notices are ignored (the blocks stay
    held), while the holder's "done" frees them."""
    import json

    from vllm_pd_ext.connectors.common.side_channel import SideChannelError, post_json

    p, _, d, _, port = pair
    assert p.transport is not None and d.transport is not None
    p.bind(PdTransferMetadata(send=[SendSpec("p-req", "read", ((1, 2),))]))
    assert p.get_finished({"p-req"}) == (None, None)
    post_json("127.0.0.1", port, "/renew", {"req": "p-req", "engine_id": d.transport.engine_id}, 2)
    evil = third_peer(backend)
    try:
        with pytest.raises(SideChannelError, match="leased to another peer"):
            post_json("127.0.0.1", port, "/renew", {"req": "p-req", "engine_id": evil.engine_id}, 2)
        peer = evil.connect(p.transport.descriptor())
        for op in ("renew", "done"):
            evil.notify(peer, json.dumps({"op": op, "req": "p-req"}).encode())

        def ignored() -> bool:
            assert p.get_finished(set()) == (None, None), "another peer freed the blocks"
            return sum("its blocks are leased to" in r.getMessage() for r in caplog.records) == 2

        with caplog.at_level("WARNING"):
            poll(ignored, "both forged notices to be handled")
    finally:
        evil.close()
    d._notify(d.transport.connect(p.transport.descriptor()), {"op": "done", "req": "p-req"})
    assert poll(lambda: p.get_finished(set())[0], "the holder's release") == {"p-req"}


def keyed_stranger(key: bytes | None) -> TransferWorker:
    """A decode worker of the same fleet (it holds ``key``) that is part of no transfer."""
    stranger = worker("kv_consumer", free_port(), backend="tcp", key=key)
    stranger.register_kv_caches(caches(True))
    return stranger


def refused_reads(p: TransferWorker, total: int, new: int) -> None:
    """Wait until ``p``'s data server refused ``total`` requests in all; its connector stats
    count the ``new`` ones since they were last taken."""
    assert p.transport is not None
    poll(lambda: p.transport.stats.totals().ungranted >= total, f"{total} refusals")
    assert p.transport.stats.totals().ungranted == total
    taken = p.stats.take()
    assert taken is not None and taken.data["ungranted"] == new


@pytest.mark.parametrize("backend", ["tcp"])
@pytest.mark.parametrize("pair", [{"key": KEY}], indirect=True, ids=["fleet key"])
def test_a_fleet_peer_reads_only_the_blocks_leased_to_it(pair):
    """Two finished requests' blocks are held. The decode transport that claims the lease of
    one (its /renew right before reading) reads those blocks, and not the other request's; a
    worker of the same fleet that claimed nothing reads neither; once the holder says "done"
    its blocks are not readable any more. Every refused request is counted (one per layer)."""
    from vllm_pd_ext.transport import TransferError

    p, pc, d, dc, port = pair
    assert p.transport is not None and d.transport is not None
    p.bind(
        PdTransferMetadata(
            send=[SendSpec("p-req", "read", ((1, 2),)), SendSpec("p-other", "read", ((3,),))]
        )
    )
    assert p.get_finished({"p-req", "p-other"}) == (None, None)
    ref = RemoteRef(p.engine_id, "127.0.0.1", port, "p-req")
    body = {"req": "p-req", "engine_id": d.transport.engine_id}
    post_json("127.0.0.1", port, "/renew", body, 2.0, KEY)
    deadline = time.monotonic() + 10

    def read(w: TransferWorker, pairs) -> None:
        w._read([w._peer(ref)], (pairs,), deadline)

    read(d, ((5, 1), (6, 2)))
    assert_copied(pc, dc, [(1, 5), (2, 6)])
    with pytest.raises(TransferError, match="read outside the spans granted"):
        read(d, ((7, 3),))  # leased to nobody yet
    refused_reads(p, LAYERS, LAYERS)
    stranger = keyed_stranger(KEY)
    try:
        with pytest.raises(TransferError, match="read outside the spans granted"):
            read(stranger, ((5, 1),))  # leased to d
        refused_reads(p, 2 * LAYERS, LAYERS)
    finally:
        stranger.shutdown()
    d._notify(d._peer(ref).peer_id, {"op": "done", "req": "p-req"})
    assert poll(lambda: p.get_finished(set())[0], "the holder's release") == {"p-req"}
    with pytest.raises(TransferError, match="read outside the spans granted"):
        read(d, ((5, 1),))  # freed: the blocks may hold another request's KV any moment
    refused_reads(p, 3 * LAYERS, LAYERS)
    assert torch.count_nonzero(block(dc, next(iter(dc)), 7)) == 0


@pytest.mark.parametrize("backend", ["tcp"])
def test_a_lease_that_runs_out_is_not_readable(pair):
    from vllm_pd_ext.transport import TransferError

    p, _pc, d, dc, port = pair
    assert d.transport is not None
    p.bind(PdTransferMetadata(send=[SendSpec("p-req", "read", ((1,),))]))
    p.get_finished({"p-req"})
    ref = RemoteRef(p.engine_id, "127.0.0.1", port, "p-req")
    post_json("127.0.0.1", port, "/renew", {"req": "p-req", "engine_id": d.transport.engine_id}, 2)
    p.clock.now += p.cfg.lease_s + 1
    assert p.get_finished(set()) == ({"p-req"}, None)
    with pytest.raises(TransferError, match="read outside the spans granted"):
        d._read([d._peer(ref)], (((5, 1),),), time.monotonic() + 10)
    assert torch.count_nonzero(block(dc, next(iter(dc)), 5)) == 0


def hold_writes(w: TransferWorker, events: list[str]) -> threading.Event:
    """Hold every WRITE into ``w`` (its tcp or cma data server) before it lands, until the
    event returned is set; each appends "write ended" to ``events`` once it landed."""
    from vllm_pd_ext.transport.cma import _CMA_WRITE
    from vllm_pd_ext.transport.tcp import _WRITE

    server = w.transport._server  # type: ignore[union-attr]
    serve, gate = server._request, threading.Event()

    def held(link, session, req) -> None:
        if req.kind not in (_WRITE, _CMA_WRITE):
            return serve(link, session, req)
        gate.wait()
        serve(link, session, req)
        events.append("write ended")

    server._request = held
    return gate


@pytest.mark.parametrize("backend", ["tcp", "cma"])
@pytest.mark.parametrize("released", ["when the push times out", "when the decode cancels"])
def test_a_failed_push_lets_the_decode_reuse_its_blocks_only_once_its_writes_ended(
    backend, released
):
    """The prefill's push times out (its lease) while its writes are still landing in the
    decode's blocks: the decode's data server holds them until the push timed out (then the
    prefill tells the decode it failed), or until the decode gave up waiting and cancelled.
    The decode fails its load (its blocks go back to vLLM), and the prefill's push ends,
    only after every write ended."""
    port = free_port()
    p = worker(
        "kv_producer",
        port,
        backend=backend,
        lease_s=0.5,
        handshake_timeout_s=1.0,
        transfer_timeout_s=10.0,
    )
    # (a decode's bound on its cancel, not what is tested here: beyond the polls below)
    d = worker(
        "kv_consumer",
        free_port(),
        backend=backend,
        transfer_timeout_s=3.0,
        handshake_timeout_s=30.0,
    )
    events: list[str] = []
    gate = threading.Event()
    try:
        pc = caches(True)
        p.register_kv_caches(pc)
        d.register_kv_caches(caches(False))
        assert p.transport is not None
        gate = hold_writes(d, events)
        p.bind(PdTransferMetadata(push=[PushSpec("p-req", "t-h", ((1, 2),), PROMPT_HASH)]))
        write_offer(d, port, "t-h", ((4, 0), (8, 1)))
        poll(lambda: "t-h" in p._targets, "the decode offer")
        for layer in pc:
            p.save_kv_layer(layer)
        p.wait_for_save()

        def ended() -> bool:
            if released == "when the decode cancels":
                if "t-h" in p._cancelled:
                    gate.set()
            elif p.transport.stats.totals().timeouts:  # type: ignore[union-attr]
                gate.set()
            p.get_finished(set())
            if not p._push_futures and "push ended" not in events:
                events.append("push ended")
            if d.get_finished(set())[1]:
                events.append("load failed")
            return "push ended" in events and "load failed" in events

        poll(ended, "the push's and the load's ends", timeout=20.0)
        assert events.count("write ended") == LAYERS, events
        last_write = len(events) - 1 - events[::-1].index("write ended")
        assert last_write < events.index("push ended"), events
        assert last_write < events.index("load failed"), events
        assert d.get_block_ids_with_load_errors() == {4, 8}
    finally:
        gate.set()
        d.shutdown()
        p.shutdown()


@pytest.mark.parametrize("backend", ["tcp", "cma"])
def test_a_cancel_is_answered_at_once_and_the_decode_keeps_its_blocks_until_writes_end(backend):
    """The decode times out waiting for "written" while the prefill's writes into its blocks
    are held by its data server, and cancels. The prefill answers at once that they are not
    settled (the decode asks again while none has landed: the prefill's side channel is not
    kept waiting for them), and the decode fails its load, giving its blocks back to vLLM,
    only once every write ended and the prefill said so."""
    port = free_port()
    p = worker(
        "kv_producer",
        port,
        backend=backend,
        lease_s=60.0,
        handshake_timeout_s=60.0,
        transfer_timeout_s=60.0,
    )
    # (a decode's bound on its cancel, not what is tested here: beyond the polls below)
    d = worker(
        "kv_consumer",
        free_port(),
        backend=backend,
        transfer_timeout_s=1.0,
        handshake_timeout_s=30.0,
    )
    events: list[str] = []
    asks: list[dict | None] = []
    gate = threading.Event()
    try:
        pc = caches(True)
        p.register_kv_caches(pc)
        d.register_kv_caches(caches(False))
        gate = hold_writes(d, events)
        assert p._server is not None
        cancel = p._server._post_routes["/cancel"]

        def counted(body: dict) -> dict | None:
            answer = cancel(body)
            asks.append(answer)
            return answer

        p._server._post_routes["/cancel"] = counted
        p.bind(PdTransferMetadata(push=[PushSpec("p-req", "t-a", ((1, 2),), PROMPT_HASH)]))
        write_offer(d, port, "t-a", ((4, 0), (8, 1)))
        poll(lambda: "t-a" in p._targets, "the decode offer")
        for layer in pc:
            p.save_kv_layer(layer)
        p.wait_for_save()

        def load_failed() -> bool:
            if len(asks) >= 2:  # asked again: the first answer came while writes were held
                gate.set()
            if d.get_finished(set())[1]:
                events.append("load failed")
            return "load failed" in events

        poll(load_failed, "the decode's failed load", timeout=30.0)
        assert asks[0] == {"settled": False} and asks[-1] == {"settled": True}, asks
        assert events == ["write ended"] * LAYERS + ["load failed"], events
        assert d.get_block_ids_with_load_errors() == {4, 8}
        poll(lambda: p.get_finished(set()) and not p._push_futures, "the push's end")
    finally:
        gate.set()
        d.shutdown()
        p.shutdown()


@pytest.mark.parametrize("backend", ["tcp", "cma"])
def test_after_a_cancel_each_other_decode_rank_is_told_once_its_own_writes_ended(backend):
    """Prefill TP 1 writes into both ranks of a TP 2 decode engine; rank 1's data server
    holds the writes into its blocks. Rank 0 cancels: its own writes ended, so its cancel is
    settled at once; rank 1 is told that the transfer failed only after its writes ended."""
    port = free_port()
    slow = {"transfer_timeout_s": 60.0}  # beyond every poll below: only a notice ends it early
    events: list[str] = []
    with tp_engines(backend, port, 1, 2, heads=4, decode_cfg=slow) as ((p,), ds, (pc,), _):
        gate = hold_writes(ds[1], events)
        try:
            for d in ds:
                write_offer(d, port, "t-o", ((5, 0), (9, 1)))
            poll(lambda: len(p._offers("t-o")) == 2, "both offers")
            p.bind(PdTransferMetadata(push=[PushSpec("p-req", "t-o", ((1, 2),), PROMPT_HASH)]))
            for layer in pc:
                p.save_kv_layer(layer)
            ref = RemoteRef(p.engine_id, "127.0.0.1", port, None)
            ds[0]._cancel_writes(ref, [0], "t-o")
            assert "t-o" in p._unsettled  # rank 1's writes, still held
            events.append("cancelled")
            gate.set()

            def failed() -> bool:
                if ds[1].get_finished(set())[1]:
                    events.append("rank 1 failed")
                return "rank 1 failed" in events

            poll(failed, "rank 1's load")
        finally:
            gate.set()
        assert events == ["cancelled"] + ["write ended"] * LAYERS + ["rank 1 failed"], events
        assert ds[1].get_block_ids_with_load_errors() == {5, 9}


@pytest.mark.parametrize("backend", ["tcp", "cma"])
def test_a_failed_push_tells_each_decode_rank_once_its_own_writes_ended(backend):
    """Prefill TP 1 pushes into both ranks of a TP 2 decode engine and times out (its lease)
    while rank 0's data server still holds the writes into its blocks: rank 1, whose writes
    landed, is told at once that the push failed (not at its transfer timeout), while rank
    0's writes are still held; rank 0 only once they ended."""
    port = free_port()
    slow = {"transfer_timeout_s": 60.0}  # beyond every poll below: only a notice ends it early
    events: list[str] = []
    with tp_engines(backend, port, 1, 2, heads=4, decode_cfg=slow) as ((p,), ds, (pc,), _):
        p.cfg = p.cfg.model_copy(update={"lease_s": 0.5, "transfer_timeout_s": 10.0})
        gate = hold_writes(ds[0], events)
        try:
            for d in ds:
                write_offer(d, port, "t-r", ((5, 0), (9, 1)))
            poll(lambda: len(p._offers("t-r")) == 2, "both offers")
            p.bind(PdTransferMetadata(push=[PushSpec("p-req", "t-r", ((1, 2),), PROMPT_HASH)]))
            for layer in pc:
                p.save_kv_layer(layer)
            p.wait_for_save()

            def failed(rank: int) -> bool:
                if ds[rank].get_finished(set())[1]:
                    events.append(f"rank {rank} failed")
                return f"rank {rank} failed" in events

            poll(lambda: failed(1), "rank 1's load")
            gate.set()
            poll(lambda: failed(0), "rank 0's load")
        finally:
            gate.set()
        assert events.count("write ended") == LAYERS, events
        assert events.index("rank 1 failed") < events.index("write ended"), events
        last_write = len(events) - 1 - events[::-1].index("write ended")
        assert last_write < events.index("rank 0 failed"), events
        for d in ds:
            assert d.get_block_ids_with_load_errors() == {5, 9}


@pytest.mark.parametrize("backend", ["tcp"])
@pytest.mark.parametrize("pair", [{"key": KEY}], indirect=True, ids=["fleet key"])
def test_the_prefill_writes_only_into_the_blocks_offered_to_it(pair):
    """The decode side offers blocks 4 and 8 for a push. A write by the prefill transport into
    block 5, or by another worker of the fleet into block 4, is refused and changes nothing;
    the push itself lands; after the "written" notice the offer is withdrawn, so block 4
    takes no more writes."""
    from vllm_pd_ext.connectors.common.layout import block_spans
    from vllm_pd_ext.transport import TransferError

    p, pc, d, dc, port = pair
    assert p.transport is not None and d.transport is not None and p.layout is not None
    p.bind(PdTransferMetadata(push=[PushSpec("p-req", "t-1", ((1, 2),), PROMPT_HASH)]))
    write_offer(d, port, "t-1", ((4, 0), (8, 1)))
    poll(lambda: "t-1" in p._targets, "the decode offer")
    (target,) = p._targets["t-1"].values()

    def write(w: TransferWorker, peer: str, theirs, pairs) -> None:
        assert w.transport is not None and w.layout is not None
        mine, dest = w.layout.views[0], theirs.views[0]
        spans = block_spans(mine, dest, pairs)
        w.transport.write(peer, mine.region, dest.region, spans).wait(10)

    with pytest.raises(TransferError, match="write outside the spans granted"):
        write(p, target.peer_id, target.layout, [(1, 5)])  # a block nobody offered
    stranger = keyed_stranger(KEY)
    try:
        assert stranger.transport is not None
        peer = stranger.transport.connect(d.transport.descriptor())
        with pytest.raises(TransferError, match="write outside the spans granted"):
            write(stranger, peer, d.layout, [(1, 4)])  # offered to the prefill, not to it
    finally:
        stranger.shutdown()
    assert all(torch.count_nonzero(t) == 0 for t in dc.values())
    for layer in pc:
        p.save_kv_layer(layer)
    p.wait_for_save()
    p.bind(PdTransferMetadata(send=[SendSpec("p-req", "write", ((1, 2),), "t-1")]))
    assert poll(lambda: d.get_finished(set())[1], "the push") == {"d-req"}
    assert d.get_block_ids_with_load_errors() == set()
    assert_copied(pc, dc, [(1, 4), (2, 8)])
    with pytest.raises(TransferError, match="write outside the spans granted"):
        write(p, target.peer_id, target.layout, [(3, 4)])  # after "written"
    assert_copied(pc, dc, [(1, 4)])
    assert d.transport.stats.totals().ungranted == 3
    assert d.stats.take().data["ungranted"] == 3


def test_cancels_of_transfers_nobody_offered_are_bounded_and_forgotten():
    """/cancel for transfer ids that were never offered (or whose prefill request never
    came): at most MAX_OFFERS are remembered, and each is forgotten with the offers, two
    leases on."""
    p = worker("kv_producer", free_port(), backend="tcp")
    try:
        for i in range(MAX_OFFERS + 10):
            p._on_cancel({"transfer_id": f"nobody-{i}"})
        assert len(p._cancelled) == MAX_OFFERS
        assert "nobody-0" not in p._cancelled and f"nobody-{MAX_OFFERS + 9}" in p._cancelled
        long_ago = time.monotonic() - 3 * p.cfg.lease_s
        p._cancelled = dict.fromkeys(p._cancelled, long_ago)
        p._on_cancel({"transfer_id": "recent"})
        p._prune_offers()
        assert list(p._cancelled) == ["recent"]
    finally:
        p.shutdown()


def test_limits_set_in_the_config_reach_the_side_channel_and_the_data_server():
    """A per-source cap of 1 set in ``kv_connector_extra_config`` (``side_channel_limits``,
    and the tcp backend's ``backend_settings``) is what the prefill worker's listeners
    enforce: a second connection from one address is closed at once (the defaults admit
    dozens), while the first is held."""
    port = free_port()
    p = worker(
        "kv_producer",
        port,
        backend="tcp",
        side_channel_limits={"max_per_source": 1},
        backend_settings={"host": "127.0.0.1", "max_per_source": 1},
    )
    try:
        p.register_kv_caches(caches(True))
        assert p.transport is not None and p._server is not None
        data_port = int(p.transport.descriptor().address.rpartition(":")[2])
        for listener in (port, data_port):
            held, extra = connect_from("127.0.0.2", listener, 2)
            with held, extra:
                assert closed_within(extra, 10), listener
        assert p._server.slots.refused == 1
        assert p.transport._server.slots.refused == 1  # type: ignore[attr-defined]
    finally:
        p.shutdown()


@pytest.mark.parametrize("cma", [True, False])
def test_a_cma_fallback_to_the_socket_is_counted_in_the_connector_stats(cma: bool) -> None:
    """Two workers over the cma backend: the decode's connection to the prefill goes by
    cross-memory attach and counts no fallback; with CMA turned off on the decode side it
    falls back to the socket, and the decode's connector stats count that."""
    port = free_port()
    p = worker("kv_producer", port, backend="cma")
    d = worker(
        "kv_consumer",
        free_port(),
        backend="cma",
        backend_settings={"host": "127.0.0.1", "cma": cma},
    )
    try:
        pc, dc = caches(True), caches(False)
        p.register_kv_caches(pc)
        d.register_kv_caches(dc)
        assert d.transport is not None
        d.transport.connect(p.transport.descriptor())  # type: ignore[union-attr]
        taken = d.stats.take()
        fallbacks = taken.data["fallbacks"] if taken is not None else 0
        assert fallbacks == (0 if cma else 1)
        assert d.transport.paths() == {"cma": int(cma), "socket": int(not cma)}  # type: ignore[attr-defined]
    finally:
        d.shutdown()
        p.shutdown()
