"""What the PdExtFlexKVConnector integration tests share: the connector's config, a greedy
completion, the prompt tokens an instance counts as cached by source, polling for a value,
resetting the tiers, the SSD tier's block files."""

from __future__ import annotations

import time

from vllm_pd_ext.tools.pd_demo import completion_body, stream_completion

CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total"
MAX_TOKENS = 12


def flexkv(failure_policy: str = "recompute", **extra) -> dict:
    """kv-transfer-config of a PdExtFlexKVConnector instance with a 0.25 GB CPU tier;
    ``extra``: more ``kv_connector_extra_config`` keys."""
    return {
        "kv_connector": "PdExtFlexKVConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": failure_policy,
        "kv_connector_extra_config": {"cpu_capacity_gb": 0.25, **extra},
    }


def generate(client, server, ids, salt: str | None = None) -> list[int]:
    """``MAX_TOKENS`` greedy tokens after prompt ``ids`` (streamed) at ``server``."""
    body = completion_body(server, ids, MAX_TOKENS)
    if salt is not None:
        body["cache_salt"] = salt
    out, _ = stream_completion(client, server, body)
    assert len(out) == MAX_TOKENS
    return out


def cached(server, source: str) -> float:
    """Prompt tokens ``server`` found cached at ``source`` so far (vLLM's counter)."""
    return server.metric(CACHED_BY_SOURCE, source=source)


def eventually(fn, want, timeout: float = 20.0):
    """``fn()`` once it equals ``want``, or its last value after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        got = fn()
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.25)


def reset_cpu_tier(client, server) -> None:
    """Drop vLLM's prefix cache and the connector's CPU tier (needs VLLM_SERVER_DEV_MODE)."""
    r = client.post(f"{server.base_url}/reset_prefix_cache", params={"reset_external": "true"})
    assert r.status_code == 200, r.text


def files_in(path) -> list:
    """The block files under an SSD or shared directory, sorted."""
    return sorted(p for p in path.rglob("*.r0"))
