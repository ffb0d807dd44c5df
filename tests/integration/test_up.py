"""`vllm-pd up`: one command brings up engines and proxy (by default our connector over the
tcp backend, or vLLM's NixlConnector with one flag); Ctrl-C leaves no process behind."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest

from tests.conftest import requires_nixl_pair, requires_vllm
from tests.integration.fleet_helpers import running_up
from vllm_pd_ext.tools.pd_demo import make_prompt_ids
from vllm_pd_ext.util.prom import (
    EXTERNAL_KV,
    LOCAL_CACHE_HIT,
    LOCAL_COMPUTE,
    PROMPT_TOKENS_BY_SOURCE,
    parse_metrics,
)

pytestmark = [pytest.mark.integration, requires_vllm]


@pytest.mark.parametrize(
    ("flags", "connector"),
    [
        pytest.param([], "pdext over tcp", id="default"),
        pytest.param(["--connector", "nixl"], "nixl", id="nixl", marks=requires_nixl_pair),
    ],
)
def test_up_serves_split_requests_and_sigint_stops_everything(
    model_cache, tiny_llama, tmp_path, flags, connector
):
    args = ["--min-split-prompt-tokens", "32", "--no-cost-model", *flags]
    with running_up(args, tmp_path, model_cache) as up:
        banner, proxy = up.banner, up.proxy
        assert f"text mode, connector {connector})" in banner, banner
        decode_url = up.parts["decode-0"]
        assert len(up.children) >= 3  # two engines (with their EngineCore/workers) and the proxy

        body = {
            "model": up.model,
            "prompt": make_prompt_ids(tiny_llama, 120),
            "max_tokens": 10,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        # its own cache_salt: a prompt the decode engine holds would be served colocated
        # there (cached_on_decode: up routes on the engines' KV events)
        direct = {**body, "cache_salt": "direct"}
        expected = httpx.post(f"{decode_url}/v1/completions", json=direct, timeout=120).json()
        resp = httpx.post(f"{proxy}/v1/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["token_ids"] == expected["choices"][0]["token_ids"]
        metrics = httpx.get(f"{proxy}/metrics").text
        # the warm-up request before the banner, then ours
        assert 'vllm_pd_decisions_total{decision="split",reason="split"} 2.0' in metrics
        assert "warm-up request (long enough to split) served in" in banner
        # the engines publish their KV events and the proxy follows them: the prompts the
        # decode engine cached are in its index
        assert "KV events: the engines publish them on ipc sockets in" in banner, banner
        deadline = time.monotonic() + 60
        while (
            parse_metrics(httpx.get(f"{proxy}/metrics").text).total(
                "vllm_pd_kv_events", instance="decode-0", figure="blocks"
            )
            < 1
        ):
            assert time.monotonic() < deadline, httpx.get(f"{proxy}/metrics").text
            time.sleep(0.2)
        for engine in ("prefill-0", "decode-0"):
            if connector == "nixl":  # NIXL's progress thread polls without pause: up calmed it
                assert f"{engine}: lowered the CPU priority of 1 thread(s)" in banner, banner
            else:  # our connector has no thread that polls while the engine is idle
                assert f"{engine}: lowered the CPU priority" not in banner, banner

        if connector != "nixl":
            _non_streamed_split_answers_from_the_decodes_cache(proxy, decode_url, body, tiny_llama)
            # doctor on the stack as up leaves it (prefix caching on): its colocated run must not
            # warm the decode's cache for its split one (it did: "NOT loaded", falsely)
            report = _doctor(up.parts["prefill-0"], decode_url)
            assert not any("NOT loaded" in a for a in report["advice"]), report["advice"]
            for r in report["rounds"]:
                assert r["external_tokens"] >= r["prompt_tokens"] - 1, r
                assert r["local_cache_hit_tokens"] == 0 and r["recomputed_tokens"] <= 1, r
            # both engines are on this host and idle before the prompts: each one's CPU is
            # measured, and ours (no poller) is not called busy; no KV was freed unread or
            # failed to load during the run
            assert [(e["role"], e["note"]) for e in report["idle"]] == [
                ("prefill", ""),
                ("decode", ""),
            ], report["idle"]
            assert all(e["cpu_pct"] is not None for e in report["idle"]), report["idle"]
            assert not any("busy-polls" in a for a in report["advice"]), report["advice"]
            assert report["kv_counter_moves"] == [], report["kv_counter_moves"]
    # running_up stopped it with SIGINT: exit 0, every process it started gone


def _non_streamed_split_answers_from_the_decodes_cache(
    proxy: str, decode_url: str, body: dict, tiny_llama
) -> None:
    """A non-streamed split on a real pair (prefix caching on, as up leaves it): the decode
    engine loads the prompt's KV in a one-token first step, then answers the request from its
    prefix cache, computing at most the prompt's last partial block; the answer is greedy
    colocated's."""
    prompt = make_prompt_ids(tiny_llama, 200)
    alone = {**body, "prompt": prompt, "cache_salt": "colocated"}
    expected = httpx.post(f"{decode_url}/v1/completions", json=alone, timeout=120).json()
    before = parse_metrics(httpx.get(f"{decode_url}/metrics").text)
    (block,) = before.by_label("vllm:cache_config_info", "block_size")
    split = {**alone, "cache_salt": "split"}  # nothing of it in either engine's cache
    resp = httpx.post(f"{proxy}/v1/completions", json=split, timeout=120)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["token_ids"] == expected["choices"][0]["token_ids"]
    after = parse_metrics(httpx.get(f"{decode_url}/metrics").text)

    def moved(source: dict) -> float:
        return after.total(PROMPT_TOKENS_BY_SOURCE, **source) - before.total(
            PROMPT_TOKENS_BY_SOURCE, **source
        )

    assert moved(EXTERNAL_KV) >= 199  # the first step: the KV over the connector
    assert moved(LOCAL_CACHE_HIT) >= 200 - int(block)  # the second: from the prefix cache
    assert moved(LOCAL_COMPUTE) <= int(block) + 1
    proxy_metrics = parse_metrics(httpx.get(f"{proxy}/metrics").text)
    assert proxy_metrics.total("vllm_pd_fallbacks_total") == 0


def _doctor(prefill_url: str, decode_url: str) -> dict:
    """`vllm-pd doctor --json` against the stack's pair; its parsed report."""
    pair = ["--prefill", prefill_url, "--decode", decode_url]
    argv = [sys.executable, "-m", "vllm_pd_ext.cli", "doctor", *pair, "--prompt-tokens", "300"]
    argv += ["--prompts", "2", "--json"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)
