"""PdExtMambaStateConnector's scheduler side through vLLM's real Scheduler with a hybrid
KVCacheConfig (a Mamba2 state group and a full-attention group, as for GraniteMoeHybrid)."""

from __future__ import annotations

import pytest
from vllm.v1.request import FinishReason, RequestStatus

from tests.unit.connectors.sched_harness import (
    BLOCK_SIZE,
    assert_scheduler_empty,
    make_request,
    make_scheduler,
    make_vllm_config,
    step,
)
from vllm_pd_ext.connectors.common.scheduler import prompt_hash
from vllm_pd_ext.transfer_params import WRITE, PdExtWriteDecode, PrefillLeg

CONNECTOR = "PdExtMambaStateConnector"


@pytest.fixture(scope="module")
def model(tiny_granite_hybrid):
    return tiny_granite_hybrid


def scheduler(model, role, mamba_type="MAMBA2", **kw):
    cfg = make_vllm_config(model, role, {"side_channel_port": 24567}, connector=CONNECTOR, **kw)
    assert not cfg.scheduler_config.disable_hybrid_kv_cache_manager  # SupportsHMA keeps it on
    return make_scheduler(cfg, hybrid=True, mamba_type=mamba_type)


def prefill(model, prompt_tokens: int):
    """Run a prefill request; return (its kv_transfer_params, the request, its scheduler)."""
    sched = scheduler(model, "kv_producer")
    req = make_request(prompt_tokens, {"do_remote_decode": True}, max_tokens=1)
    prompt = list(req.prompt_token_ids)
    sched.add_request(req)
    _, out = step(sched)
    return out[0].outputs[0].kv_transfer_params, req, sched, prompt


@pytest.mark.parametrize("prompt_tokens", [48, 41])  # N-1 a multiple of the block size, and not
def test_prefill_stops_one_token_short_and_holds_every_group(model, prompt_tokens):
    params, req, sched, prompt = prefill(model, prompt_tokens)
    n = prompt_tokens - 1
    assert req.num_prompt_tokens == n  # the last token is left to the decode side
    assert params["remote_num_tokens"] == n
    assert params["prompt_hash"] == prompt_hash(prompt, n)
    state, attention = params["remote_block_ids"]
    assert len(state) == 1  # one state page (mamba_cache_mode "none")
    assert len(attention) == -(-n // BLOCK_SIZE)
    groups = sched.kv_cache_manager.get_block_ids(req.request_id)
    assert state == groups[0] and attention == groups[1][: len(attention)]
    out, _ = step(sched)
    (send,) = out.kv_connector_metadata.send
    assert send.block_ids == (tuple(state), tuple(attention))
    step(sched, sending={req.request_id})
    assert_scheduler_empty(sched)


@pytest.mark.parametrize("prompt_tokens", [48, 41])
def test_decode_loads_n_minus_one_tokens_then_computes_the_last(model, prompt_tokens):
    params, *_ = prefill(model, prompt_tokens)
    sched = scheduler(model, "kv_consumer")
    req = make_request(prompt_tokens, dict(params), max_tokens=3)
    sched.add_request(req)
    out, _ = step(sched)
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (spec,) = out.kv_connector_metadata.recv
    local = sched.kv_cache_manager.get_block_ids(req.request_id)
    state_pairs, attention_pairs = spec.pairs
    assert state_pairs == ((local[0][0], params["remote_block_ids"][0][0]),)
    assert attention_pairs == tuple(zip(local[1], params["remote_block_ids"][1], strict=False))
    assert len(attention_pairs) == -(-(prompt_tokens - 1) // BLOCK_SIZE)
    step(sched, recving={req.request_id})
    out, _ = step(sched)
    assert out.num_scheduled_tokens[req.request_id] == 1  # token N, from state h(N-1)
    assert req.num_computed_tokens == prompt_tokens
    for _ in range(4):
        step(sched)
    assert_scheduler_empty(sched)


@pytest.mark.parametrize("prompt_tokens", [48, 41])
def test_write_sides_hash_the_same_n_minus_one_tokens(model, prompt_tokens):
    """In WRITE mode the prefill's "written" notice names the hash of the N-1 tokens it
    computed, and the decode side expects the hash of the N-1 tokens it loads: the same."""
    sched = scheduler(model, "kv_producer")
    leg = PrefillLeg(transfer_mode=WRITE, transfer_id="t-h").params()
    req = make_request(prompt_tokens, leg, max_tokens=1)
    prompt = list(req.prompt_token_ids)
    sched.add_request(req)
    (push,) = step(sched)[0].kv_connector_metadata.push
    decode = scheduler(model, "kv_consumer")
    params = PdExtWriteDecode.build("t-h", None, "127.0.0.1", 24567).signed(None)
    decode.add_request(make_request(prompt_tokens, params, prompt=list(prompt)))
    (spec,) = step(decode)[0].kv_connector_metadata.recv
    assert push.prompt_hash == spec.prompt_hash == prompt_hash(prompt, prompt_tokens - 1)


def test_decode_refuses_a_state_at_the_wrong_position(model):
    """A prefill side that computed all N tokens (e.g. another connector) must not be loaded:
    its state would be one token ahead."""
    params, *_ = prefill(model, 41)
    params["remote_num_tokens"] = 41
    sched = scheduler(model, "kv_consumer")
    req = make_request(41, dict(params))
    sched.add_request(req)
    out, _ = step(sched)
    assert out.kv_connector_metadata.recv == []
    assert out.num_scheduled_tokens[req.request_id] == 41  # computed locally
    assert [r.request_id for r in out.kv_connector_metadata.release] == [
        params["remote_request_id"]
    ]


@pytest.mark.parametrize(
    ("mamba_type", "loads"), [("MAMBA2", True), ("MAMBA1", False), ("LINEAR", False)]
)
def test_state_from_a_prefill_of_another_tp_size_loads_only_where_split_by_heads(
    model, mamba_type, loads
):
    """A READ answer from a prefill engine of TP 2 reaches a TP 1 decode engine of the hybrid
    model: Mamba2 state pages are split by heads (each decode rank reads its parts), so the
    load is planned; state of another kind (same shapes) is refused on arrival and the prompt
    computed locally."""
    params, *_ = prefill(model, 41)
    params["tp_size"] = 2
    sched = scheduler(model, "kv_consumer", mamba_type=mamba_type)
    req = make_request(41, dict(params))
    sched.add_request(req)
    out, _ = step(sched)
    if loads:
        (spec,) = out.kv_connector_metadata.recv
        assert spec.remote.tp_size == 2
    else:
        assert out.kv_connector_metadata.recv == []
        assert out.num_scheduled_tokens[req.request_id] == 41  # computed locally


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failed_hybrid_load_is_reported_by_request(model, policy):
    params, *_ = prefill(model, 41)
    sched = scheduler(model, "kv_consumer", policy=policy)
    req = make_request(41, dict(params), max_tokens=2)
    sched.add_request(req)
    step(sched)
    _, eng = step(sched, recving={req.request_id}, failed={req.request_id})
    if policy == "fail":
        assert eng[0].outputs[0].finish_reason == FinishReason.ERROR
    else:
        out, _ = step(sched)
        assert out.num_scheduled_tokens[req.request_id] == 41
        for _ in range(3):
            step(sched)
    assert_scheduler_empty(sched)
