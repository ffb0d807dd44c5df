"""PdExtMoRIIOConnector's scheduler side, driven through vLLM's real Scheduler on CPU.

The worker's part is played by the test: it reports finished sending / receiving and load
errors in the model-runner output, as the worker side would.
"""

from __future__ import annotations

import time
from typing import Any

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
from vllm_pd_ext import fleet_key
from vllm_pd_ext.connectors.common.metadata import PdTransferMetadata, RemoteRef
from vllm_pd_ext.connectors.common.scheduler import prompt_hash
from vllm_pd_ext.proxy.config import InstanceConfig
from vllm_pd_ext.proxy.protocols import make_protocol
from vllm_pd_ext.transfer_params import PdExtReadAnswer, PdExtWriteDecode

SIDE_PORT = 23456
PROMPT = 40  # two full blocks and a half one


@pytest.fixture(scope="module")
def producer_config(tiny_qwen):
    return make_vllm_config(tiny_qwen, "kv_producer", {"side_channel_port": SIDE_PORT})


@pytest.fixture(scope="module")
def consumer_config(tiny_qwen):
    return make_vllm_config(tiny_qwen, "kv_consumer")


def finished_params(producer_config, mode: str = "read", transfer_id: str | None = None) -> dict:
    """Run one prefill request on a producer scheduler; return its kv_transfer_params."""
    sched = make_scheduler(producer_config)
    params = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_mode": mode}
    if transfer_id:
        params["transfer_id"] = transfer_id
    sched.add_request(make_request(PROMPT, params, max_tokens=1))
    _, out = step(sched)
    return out[0].outputs[0].kv_transfer_params


def test_prefill_holds_blocks_until_decode_is_done(producer_config):
    sched = make_scheduler(producer_config)
    req = make_request(PROMPT, {"do_remote_decode": True, "do_remote_prefill": False}, max_tokens=1)
    sched.add_request(req)
    _, out = step(sched)
    (output,) = out[0].outputs
    assert output.finish_reason == FinishReason.LENGTH
    params = output.kv_transfer_params
    blocks = sched.kv_cache_manager.get_block_ids(req.request_id)[0]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_block_ids"] == list(blocks[:3])
    assert params["remote_num_tokens"] == PROMPT
    assert params["remote_host"] == "127.0.0.1" and params["remote_port"] == SIDE_PORT
    assert params["remote_engine_id"] == "engine-kv_producer"
    assert params["remote_request_id"] == req.request_id
    assert params["prompt_hash"] == prompt_hash(req.prompt_token_ids, PROMPT)
    # Held: the next step tells the worker to hold them under a lease...
    meta, _ = step(sched)
    meta = meta.kv_connector_metadata
    assert isinstance(meta, PdTransferMetadata)
    assert [(s.req_id, s.mode, s.block_ids) for s in meta.send] == [
        (req.request_id, "read", (tuple(params["remote_block_ids"]),))
    ]
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() < 63
    # ...until the worker reports the send finished.
    step(sched, sending={req.request_id})
    assert_scheduler_empty(sched)


def test_prefill_aborted_before_finishing_frees_at_once(producer_config):
    sched = make_scheduler(producer_config)
    req = make_request(PROMPT, {"do_remote_decode": True}, max_tokens=1)
    sched.add_request(req)
    sched.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    out, _ = step(sched)
    assert out.kv_connector_metadata.send == []
    assert_scheduler_empty(sched)


def test_write_mode_prefill_pushes_in_the_last_prompt_step(producer_config):
    sched = make_scheduler(producer_config)
    params = {"do_remote_decode": True, "transfer_mode": "write", "transfer_id": "t-1"}
    req = make_request(PROMPT, params, max_tokens=1)
    sched.add_request(req)
    out, eng = step(sched)
    (push,) = out.kv_connector_metadata.push
    assert push.req_id == req.request_id and push.transfer_id == "t-1"
    assert push.prompt_hash == prompt_hash(req.prompt_token_ids, PROMPT)  # named in "written"
    assert push.block_ids == (tuple(sched.kv_cache_manager.get_block_ids(req.request_id)[0][:3]),)
    assert eng[0].outputs[0].kv_transfer_params["transfer_mode"] == "write"
    out, _ = step(sched)
    assert [(s.mode, s.transfer_id) for s in out.kv_connector_metadata.send] == [("write", "t-1")]
    assert out.kv_connector_metadata.push == []  # pushed once
    step(sched, sending={req.request_id})
    assert_scheduler_empty(sched)


def test_decode_loads_remote_prompt_then_runs(producer_config, consumer_config):
    params = finished_params(producer_config)
    sched = make_scheduler(consumer_config)
    req = make_request(PROMPT, dict(params), max_tokens=3)
    sched.add_request(req)
    out, _ = step(sched)
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (spec,) = out.kv_connector_metadata.recv
    local = sched.kv_cache_manager.get_block_ids(req.request_id)[0][:3]
    assert spec.mode == "read"
    assert spec.pairs == (tuple(zip(local, params["remote_block_ids"], strict=True)),)
    assert spec.remote == RemoteRef(
        "engine-kv_producer", "127.0.0.1", SIDE_PORT, params["remote_request_id"], tp_size=1
    )
    assert out.total_num_scheduled_tokens == 0
    # Worker reports the load done: only the last prompt token is computed locally.
    out, _ = step(sched, recving={req.request_id})
    out, _ = step(sched)
    assert out.num_scheduled_tokens[req.request_id] == 1
    for _ in range(4):
        step(sched)
    assert_scheduler_empty(sched)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_decode_load_error_recomputes_or_fails(tiny_qwen, producer_config, policy):
    params = finished_params(producer_config)
    sched = make_scheduler(make_vllm_config(tiny_qwen, "kv_consumer", policy=policy))
    req = make_request(PROMPT, dict(params), max_tokens=2)
    sched.add_request(req)
    out, _ = step(sched)
    local = [a for a, _ in out.kv_connector_metadata.recv[0].pairs[0]]
    _, eng = step(sched, recving={req.request_id}, invalid=set(local))
    if policy == "fail":
        (output,) = eng[0].outputs
        assert output.finish_reason == FinishReason.ERROR
    else:
        out, _ = step(sched)
        assert out.num_scheduled_tokens[req.request_id] == PROMPT  # whole prompt recomputed
        for _ in range(3):
            step(sched)
    assert_scheduler_empty(sched)


def test_decode_refuses_a_different_prompt(producer_config, consumer_config):
    params = finished_params(producer_config)
    sched = make_scheduler(consumer_config)
    req = make_request(PROMPT, dict(params), prompt=[99] * PROMPT)  # not what P computed
    sched.add_request(req)
    out, _ = step(sched)
    meta = out.kv_connector_metadata
    assert meta.recv == []
    assert out.num_scheduled_tokens[req.request_id] == PROMPT  # computed locally
    assert [r.request_id for r in meta.release] == [params["remote_request_id"]]  # P freed


def test_decode_refuses_a_read_without_prompt_hash(producer_config, consumer_config):
    """Params naming a real prefill's blocks, without the hash that ties them to a prompt (as
    a client would forge them to read another request's KV): not loaded."""
    params = finished_params(producer_config)
    del params["prompt_hash"]
    sched = make_scheduler(consumer_config)
    req = make_request(PROMPT, dict(params), prompt=[99] * PROMPT)
    sched.add_request(req)
    out, _ = step(sched)
    assert out.kv_connector_metadata.recv == []
    assert out.num_scheduled_tokens[req.request_id] == PROMPT  # computed locally
    assert [r.request_id for r in out.kv_connector_metadata.release] == [
        params["remote_request_id"]
    ]


def _forgeries(params: dict) -> dict[str, dict]:
    other_key = bytes.fromhex("cd" * 32)
    return {
        "unsigned": {k: v for k, v in params.items() if k != fleet_key.SIGNATURE},
        "host changed": {**params, "remote_host": "10.0.0.9"},
        "blocks changed": {**params, "remote_block_ids": [7, 8, 9]},
        "another key": {
            **params,
            "signature": fleet_key.sign(other_key, params, PdExtReadAnswer.signed_fields()),
        },
        "signature not a string": {**params, "signature": 1},
    }


def test_with_a_fleet_key_decode_loads_signed_params_only(
    producer_config, consumer_config, monkeypatch
):
    """A prefill signs its answer; a decode loads it, and refuses every forgery of it (the
    prompt is computed locally, and nothing is sent to the host a forgery names)."""
    monkeypatch.setenv(fleet_key.KEY_ENV, "ab" * 32)
    params = finished_params(producer_config)
    assert fleet_key.verify(bytes.fromhex("ab" * 32), params, PdExtReadAnswer.signed_fields())
    sched = make_scheduler(consumer_config)
    sched.add_request(make_request(PROMPT, dict(params)))
    out, _ = step(sched)
    assert len(out.kv_connector_metadata.recv) == 1  # the real answer loads
    for name, forged in _forgeries(params).items():
        sched = make_scheduler(consumer_config)
        req = make_request(PROMPT, dict(forged))
        sched.add_request(req)
        out, _ = step(sched)
        meta = out.kv_connector_metadata
        assert meta.recv == [], name
        assert out.num_scheduled_tokens[req.request_id] == PROMPT, name  # computed locally
        assert meta.release == [] and meta.renew == [], name


def test_with_a_fleet_key_decode_takes_write_params_the_proxy_signed_only(
    consumer_config, monkeypatch
):
    """The proxy's pdext-write protocol, given the key, signs the decode leg's params; a
    decode engine with the key plans the offer for them and for no forgery of them."""
    monkeypatch.setenv(fleet_key.KEY_ENV, "ab" * 32)
    prefill = InstanceConfig(
        url="http://127.0.0.1:1", role="prefill", bootstrap_addr=f"127.0.0.1:{SIDE_PORT}"
    )
    decode = InstanceConfig(url="http://127.0.0.1:2", role="decode")
    protocol = make_protocol("pdext-write", bytes.fromhex("ab" * 32))
    params = protocol.plan("req-1", prefill, decode).decode_params
    assert params is not None
    sched = make_scheduler(consumer_config)
    sched.add_request(make_request(PROMPT, dict(params)))
    out, _ = step(sched)
    assert [spec.mode for spec in out.kv_connector_metadata.recv] == ["write"]
    unsigned = make_protocol("pdext-write").plan("req-2", prefill, decode).decode_params
    assert unsigned is not None
    other_key = bytes.fromhex("cd" * 32)
    forgeries = {
        "unsigned": unsigned,
        "host changed": {**params, "remote_host": "10.0.0.9"},
        "transfer id changed": {**params, "transfer_id": "someone-elses"},
        "another key": {
            **params,
            "signature": fleet_key.sign(other_key, params, PdExtWriteDecode.signed_fields()),
        },
    }
    for name, forged in forgeries.items():
        sched = make_scheduler(consumer_config)
        req = make_request(PROMPT, dict(forged))
        sched.add_request(req)
        out, _ = step(sched)
        assert out.kv_connector_metadata.recv == [], name
        assert out.num_scheduled_tokens[req.request_id] == PROMPT, name  # computed locally


@pytest.mark.parametrize(
    ("prefill_tp", "refusal"),
    [
        (2, "prefill TP 2 is more than the model's 1 KV heads"),
        (0, "one is below 1"),
    ],
)
def test_decode_refuses_a_prefill_of_a_tp_size_that_cannot_split_heads_on_arrival(
    producer_config, consumer_config, caplog, prefill_tp, refusal
):
    """A READ answer from a prefill engine whose TP size does not split the model's one KV
    head reaches a TP 1 decode engine: refused on arrival with a message naming both sizes
    and counted; no block is read, the prompt is computed locally and the prefill is told to
    free its blocks at once."""
    caplog.set_level("WARNING", logger="vllm_pd_ext.connectors.common.scheduler")
    params = {**finished_params(producer_config), "tp_size": prefill_tp}
    sched = make_scheduler(consumer_config)
    req = make_request(PROMPT, params)
    sched.add_request(req)
    assert _refused_on_arrival(sched) == 1
    out, _ = step(sched)
    assert out.kv_connector_metadata.recv == []
    assert out.num_scheduled_tokens[req.request_id] == PROMPT  # computed locally
    assert [r.request_id for r in out.kv_connector_metadata.release] == [
        params["remote_request_id"]
    ]
    assert f"tensor parallel sizes differ (prefill TP {prefill_tp}, decode TP 1)" in caplog.text
    assert refusal in caplog.text


def test_decode_loads_from_a_prefill_of_another_tp_size_that_splits_heads(tiny_llama):
    """A READ answer from a prefill engine of TP 2 (one of the model's two KV heads a rank)
    reaches a TP 1 decode engine: the load is planned, and the worker learns the prefill's TP
    size (it reads both prefill ranks)."""
    producer = make_vllm_config(tiny_llama, "kv_producer", {"side_channel_port": SIDE_PORT})
    params = {**finished_params(producer), "tp_size": 2}
    sched = make_scheduler(make_vllm_config(tiny_llama, "kv_consumer"))
    req = make_request(PROMPT, params)
    sched.add_request(req)
    assert _refused_on_arrival(sched) == 0
    out, _ = step(sched)
    [spec] = out.kv_connector_metadata.recv
    assert spec.mode == "read" and spec.remote.tp_size == 2


def test_decode_refuses_too_few_remote_blocks(producer_config, consumer_config):
    params = finished_params(producer_config)
    params["remote_block_ids"] = params["remote_block_ids"][:1]
    sched = make_scheduler(consumer_config)
    req = make_request(PROMPT, dict(params))
    sched.add_request(req)
    out, _ = step(sched)
    assert out.kv_connector_metadata.recv == []
    assert out.num_scheduled_tokens[req.request_id] == PROMPT


def test_decode_aborted_in_queue_releases_prefill_blocks(producer_config, consumer_config):
    params = finished_params(producer_config)
    sched = make_scheduler(consumer_config)
    req = make_request(PROMPT, dict(params))
    sched.add_request(req)
    sched.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    out, _ = step(sched)
    assert out.kv_connector_metadata.recv == []
    assert [r.request_id for r in out.kv_connector_metadata.release] == [
        params["remote_request_id"]
    ]
    assert_scheduler_empty(sched)


def test_decode_aborted_while_loading_keeps_blocks_until_the_load_ends(
    producer_config, consumer_config
):
    params = finished_params(producer_config)
    sched = make_scheduler(consumer_config)
    req = make_request(PROMPT, dict(params))
    sched.add_request(req)
    step(sched)
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    sched.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    step(sched)
    assert req.request_id in sched.requests  # the transfer may still write these blocks
    step(sched, recving={req.request_id})
    assert_scheduler_empty(sched)


def test_decode_renews_the_lease_while_queued(tiny_qwen, producer_config):
    params = finished_params(producer_config)
    sched = make_scheduler(
        make_vllm_config(tiny_qwen, "kv_consumer", {"lease_s": 0.3}, max_num_seqs=1)
    )
    blocker = make_request(PROMPT, None, max_tokens=50)
    sched.add_request(blocker)
    step(sched)
    req = make_request(PROMPT, dict(params))
    sched.add_request(req)  # waits: one sequence at a time
    renewed: list[Any] = []
    deadline = time.monotonic() + 5
    while not renewed and time.monotonic() < deadline:
        out, _ = step(sched)
        renewed = out.kv_connector_metadata.renew
        time.sleep(0.05)
    assert [r.request_id for r in renewed] == [params["remote_request_id"]]
    assert req.status == RequestStatus.WAITING


def test_write_mode_decode_plans_an_offer(producer_config, consumer_config):
    sched = make_scheduler(consumer_config)
    params = PdExtWriteDecode.build("t-9", None, "127.0.0.1", SIDE_PORT).signed(None)
    req = make_request(PROMPT, params)
    sched.add_request(req)
    out, _ = step(sched)
    (spec,) = out.kv_connector_metadata.recv
    local = sched.kv_cache_manager.get_block_ids(req.request_id)[0][:3]
    assert spec.mode == "write" and spec.transfer_id == "t-9"
    assert spec.prompt_hash == prompt_hash(req.prompt_token_ids, PROMPT)  # checked on "written"
    assert spec.local_block_ids == (tuple(local),)
    assert [r for _, r in spec.pairs[0]] == [0, 1, 2]  # offered in prompt order
    assert len(local) * BLOCK_SIZE >= PROMPT


def _refused_on_arrival(sched) -> int:
    stats = sched.connector.get_kv_connector_stats()
    return stats.data["params_refused"] if stats is not None else 0


def test_with_a_fleet_key_decode_refuses_params_that_arrive_expired(
    producer_config, consumer_config, monkeypatch
):
    """Signed params replayed after they expired (past the clock skew allowed) are refused on
    arrival and counted; the prompt is computed locally and the prefill is told to free its
    blocks (the params are authentic, only late)."""
    monkeypatch.setenv(fleet_key.KEY_ENV, "ab" * 32)
    params = finished_params(producer_config)
    answer = PdExtReadAnswer.parse(params)
    late = answer.expires_at + fleet_key.MAX_SKEW_S + 1
    monkeypatch.setattr(time, "time", lambda: late)
    sched = make_scheduler(consumer_config)
    req = make_request(PROMPT, dict(params))
    sched.add_request(req)
    assert _refused_on_arrival(sched) == 1
    out, _ = step(sched)
    assert out.kv_connector_metadata.recv == []
    assert out.num_scheduled_tokens[req.request_id] == PROMPT  # computed locally
    assert [r.request_id for r in out.kv_connector_metadata.release] == [answer.remote_request_id]


def test_params_checked_fresh_on_arrival_still_load_after_they_expire(
    producer_config, consumer_config, monkeypatch
):
    """Expiry is checked when a request arrives, not when the engine gets round to it: a
    request queued behind others past its params' expiry still loads."""
    monkeypatch.setenv(fleet_key.KEY_ENV, "ab" * 32)
    params = finished_params(producer_config)
    answer = PdExtReadAnswer.parse(params)
    sched = make_scheduler(consumer_config)
    req = make_request(PROMPT, dict(params))
    sched.add_request(req)  # arrives fresh
    assert _refused_on_arrival(sched) == 0
    monkeypatch.setattr(time, "time", lambda: answer.expires_at + fleet_key.MAX_SKEW_S + 60)
    out, _ = step(sched)
    assert len(out.kv_connector_metadata.recv) == 1


def test_decode_refuses_params_of_another_contract_version(producer_config, consumer_config):
    params = {**finished_params(producer_config), "pdext_version": 2}
    sched = make_scheduler(consumer_config)
    req = make_request(PROMPT, params)
    sched.add_request(req)
    assert _refused_on_arrival(sched) == 1
    out, _ = step(sched)
    assert out.kv_connector_metadata.recv == []
    assert out.num_scheduled_tokens[req.request_id] == PROMPT


def test_signature_covers_expiry_and_version(producer_config, consumer_config, monkeypatch):
    """Pushing a captured answer's expiry forward (or relabelling its version) breaks its
    signature: refused."""
    monkeypatch.setenv(fleet_key.KEY_ENV, "ab" * 32)
    params = finished_params(producer_config)
    for name, forged in {
        "expiry pushed": {**params, "expires_at": params["expires_at"] + 3600},
        "lease stretched": {**params, "lease_s": 3600.0},
    }.items():
        sched = make_scheduler(consumer_config)
        req = make_request(PROMPT, forged)
        sched.add_request(req)
        assert _refused_on_arrival(sched) == 1, name
        out, _ = step(sched)
        assert out.kv_connector_metadata.recv == [], name
        assert out.kv_connector_metadata.release == [], name  # a forgery's host: no contact
