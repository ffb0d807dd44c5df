"""The core of benchmarks/tp_transfer.py on a tiny model, prefill ranks in this process: a
decode rank of TP 1 READs one request from prefill engines of TP 2 and TP 1 over the ``tcp``
backend, and the check finds every head where it belongs (and finds a head that is not)."""

from __future__ import annotations

import pytest

from tests.skips import need

need("vllm", why="the connector's worker metadata is vLLM's", allow_module_level=True)

from vllm_pd_ext.testing.kv_ranks import (  # noqa: E402
    KVShape,
    PrefillEngine,
    check_landed,
    model_kv,
    rank_caches,
    rank_worker,
    read_request,
)
from vllm_pd_ext.util.vllm_process import free_port  # noqa: E402

SHAPE = KVShape(layers=2, kv_heads=4, head_dim=8, block_size=4, dtype="float32")
NUM_BLOCKS, SEED = 6, 3
PAIRS = ((5, 1), (1, 3), (3, 2))  # (decode block, prefill block)


@pytest.fixture
def decode():
    d = rank_worker("kv_consumer", "decode", free_port(), "tcp", SHAPE, NUM_BLOCKS)
    caches = rank_caches(SHAPE, NUM_BLOCKS, 1, 0, None)
    d.register_kv_caches(caches)
    yield d, caches
    d.shutdown()


@pytest.mark.parametrize("tp_size", [2, 1])
def test_a_read_from_each_prefill_tp_size_lands_every_head(decode, tp_size):
    d, caches = decode
    model = {SHAPE.layer_name(i): model_kv(SHAPE, NUM_BLOCKS, SEED, i) for i in range(2)}
    engine = PrefillEngine(
        "prefill", free_port(), "tcp", SHAPE, NUM_BLOCKS, SEED, tp_size, spawn=False
    )
    try:
        for n, req in enumerate(("first", "second")):  # the second reuses the connections
            for t in caches.values():
                t.zero_()
            engine.hold(req, tuple(r for _, r in PAIRS))
            load = read_request(d, engine.ref(req), PAIRS, req)
            engine.wait_released(req)
            per_block = SHAPE.token_bytes * SHAPE.block_size
            assert load.nbytes == len(PAIRS) * per_block, n
            assert check_landed(SHAPE, caches, model, PAIRS) == load.nbytes
            assert not caches[SHAPE.layer_name(0)][0].any()  # the null block: untouched
    finally:
        engine.stop()
    layer = SHAPE.layer_name(1)
    caches[layer][5, 3, 0, 0] += 1  # the last head of one decode block: not the model's
    with pytest.raises(AssertionError, match=layer):
        check_landed(SHAPE, caches, model, PAIRS)
