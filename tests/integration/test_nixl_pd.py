"""A real P/D pair (vLLM's NixlConnector on CPU): split output equals colocated output."""

from __future__ import annotations

import httpx
import pytest

from tests.integration.fleet_helpers import nixl_pair
from vllm_pd_ext.tools.pd_demo import PREFILL_PARAMS, run_pd_round_trip
from vllm_pd_ext.util.prom import EXTERNAL_KV, PROMPT_TOKENS_BY_SOURCE

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pair(vllm_servers, tiny_qwen):
    return nixl_pair(vllm_servers, tiny_qwen, "nixl")


@pytest.mark.parametrize("prompt_tokens", [97, 256, 300])
def test_completion_tokens_equal_and_kv_transferred(pair, tiny_qwen, prompt_tokens):
    prefill, decode = pair
    result = run_pd_round_trip(prefill, decode, tiny_qwen, prompt_tokens, max_tokens=24)
    assert result.prompt_tokens == prompt_tokens
    assert len(result.pd_token_ids) == 24
    assert result.pd_token_ids == result.colocated_token_ids
    assert result.decode_external_kv_tokens >= prompt_tokens - 1
    assert result.decode_local_compute_tokens <= 1


def test_chat_completion_split_equals_colocated(pair):
    prefill, decode = pair
    messages = [
        {"role": "system", "content": "You answer in one short paragraph."},
        {
            "role": "user",
            "content": "Explain why prefill is compute-bound and decode is "
            "memory-bound, and what a KV cache transfer costs. " * 4,
        },
    ]

    def body(server, **extra):
        return {
            "model": server.served_name,
            "messages": messages,
            "max_tokens": 20,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": True,
            **extra,
        }

    with httpx.Client(timeout=120) as client:
        colocated = client.post(f"{prefill.base_url}/v1/chat/completions", json=body(prefill))
        assert colocated.status_code == 200, colocated.text
        before = decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV)
        leg1 = client.post(
            f"{prefill.base_url}/v1/chat/completions",
            json=body(prefill, max_tokens=1, kv_transfer_params=PREFILL_PARAMS),
        )
        assert leg1.status_code == 200, leg1.text
        params = leg1.json()["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["remote_block_ids"]
        leg2 = client.post(
            f"{decode.base_url}/v1/chat/completions", json=body(decode, kv_transfer_params=params)
        )
        assert leg2.status_code == 200, leg2.text

    def tokens(resp):
        return [t["token"] for t in resp.json()["choices"][0]["logprobs"]["content"]]

    assert tokens(leg2) == tokens(colocated)
    assert (
        leg2.json()["choices"][0]["message"]["content"]
        == (colocated.json()["choices"][0]["message"]["content"])
    )
    prompt_tokens = colocated.json()["usage"]["prompt_tokens"]
    received = decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV) - before
    assert received >= prompt_tokens - 1
