"""Capacity-aware splits: a split is sent to a decode instance only when its prompt's KV fits
in the instance's free KV blocks (from its /metrics), else it runs colocated or waits."""

from __future__ import annotations

import threading

import httpx

from tests.unit.proxy.helpers import fleet, metric, proxy, sent, wait_until
from tests.unit.proxy.test_fleet_load import METRICS
from tests.unit.proxy.test_policies_and_decision import Node, ctx
from vllm_pd_ext.proxy.config import DecisionConfig, InstanceConfig
from vllm_pd_ext.proxy.decision import Decider, blocks_needed
from vllm_pd_ext.proxy.fleet import Fleet, Instance
from vllm_pd_ext.proxy.upstream import Upstream

PROMPT = list(range(1000, 1400))  # 400 tokens: 25 blocks of 16, 26 with the first token's


def cache_info(num_gpu_blocks: str, block_size: str = "16") -> str:
    """vLLM's cache settings gauge, as a real engine writes it (some of its labels)."""
    return (
        "# TYPE vllm:cache_config_info gauge\n"
        f'vllm:cache_config_info{{block_size="{block_size}",cache_dtype="auto",'
        'enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",'
        f'num_cpu_blocks="None",num_gpu_blocks="{num_gpu_blocks}",'
        'num_gpu_blocks_override="None",prefix_caching_hash_algo="sha256"} 1.0\n'
    )


def test_free_blocks_come_from_the_cache_size_and_usage_less_what_was_routed_there():
    inst = Instance(
        InstanceConfig(url="http://e:1"), client=Upstream("http://e:1", max_connections=1)
    )
    assert inst.free_blocks() is None  # never scraped
    Fleet._read_load(inst, METRICS.encode())
    assert inst.free_blocks() is None  # no cache size in the scrape: not known
    Fleet._read_load(inst, (METRICS + cache_info("None")).encode())
    assert inst.free_blocks() is None  # before vLLM's profiling has sized it
    Fleet._read_load(inst, (METRICS + cache_info("1000", "32")).encode())
    assert (inst.kv_blocks, inst.block_size) == (1000, 32)
    assert inst.free_blocks() == 750  # usage 0.25
    inst.reserved_blocks, inst.landed_blocks = 10, 5
    assert inst.free_blocks() == 735
    Fleet._read_load(inst, (METRICS + cache_info("1000", "32")).encode())
    assert inst.free_blocks() == 740  # the scrape's usage shows what landed before it


def test_a_split_that_does_not_fit_the_decode_runs_colocated():
    decider, prefill, decode = Decider(DecisionConfig()), Node("p"), Node("d")
    need = blocks_needed(400, 0, 16)
    assert need == 26
    assert decider.decide(ctx(400), [prefill], decode, None, (need, 16)).split
    full = decider.decide(ctx(400), [prefill], decode, None, (need - 1, 16))
    assert (full.split, full.reason) == (False, "decode_full")
    assert full.inputs["kv_blocks_needed"] == need
    # blocks its prefix cache holds are not transferred
    assert blocks_needed(400, 96, 16) == 20
    assert decider.decide(ctx(400), [prefill], decode, 96, (20, 16)).split
    # not known: the rule does not apply; off: it never does
    assert decider.decide(ctx(400), [prefill], decode, None, None).split
    off = Decider(DecisionConfig(decode_room="off"))
    assert off.decide(ctx(400), [prefill], decode, None, (0, 16)).split


def test_the_proxy_never_splits_onto_a_decode_without_room(engines):
    engines["d1"].behavior.kv_blocks = 25  # one block short of the prompt's KV
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 4}
    with proxy(engines, instances=fleet(engines, decode=("d1",))) as (base, _):
        wait_until(lambda: metric(base, "vllm_pd_kv_room_blocks", instance=engines["d1"].url))
        assert httpx.post(f"{base}/v1/completions", json=body).status_code == 200
        assert metric(base, "vllm_pd_decisions_total", reason="decode_full") == 1
        assert not sent(engines["p1"]) and not sent(engines["p2"])
        assert len(sent(engines["d1"])) == 1
        engines["d1"].behavior.kv_blocks = 26  # room now, by the next scrape
        wait_until(lambda: metric(base, "vllm_pd_kv_room_blocks", instance=engines["d1"].url) == 26)
        assert httpx.post(f"{base}/v1/completions", json=body).status_code == 200
        assert metric(base, "vllm_pd_decisions_total", decision="split") == 1


def test_a_split_in_flight_holds_its_room_until_its_kv_lands(engines):
    """Room taken by a split routed since the last scrape counts at once: a second split
    that would not fit beside it runs colocated, though the scrape still shows room."""
    engines["d1"].behavior.kv_blocks = 40  # room for one 26-block prompt, not two
    engines["d1"].behavior.kv_stall_s = 30  # the first split's KV load hangs
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 4, "stream": True}
    with proxy(
        engines,
        instances=fleet(engines, decode=("d1",)),
        stall_guard={"enabled": False},
    ) as (base, _):
        d1 = engines["d1"].url
        wait_until(lambda: metric(base, "vllm_pd_kv_room_blocks", instance=d1) == 40)
        first = threading.Thread(
            target=lambda: httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        )
        first.start()
        try:
            wait_until(lambda: metric(base, "vllm_pd_kv_room_blocks", instance=d1) == 14)
            second = httpx.post(f"{base}/v1/completions", json={**body, "stream": False})
            assert second.status_code == 200
            assert metric(base, "vllm_pd_decisions_total", reason="decode_full") == 1
            assert metric(base, "vllm_pd_decisions_total", decision="split") == 1
        finally:
            engines["d1"].behavior.kv_stall_s = 0
            first.join(timeout=60)
        assert not first.is_alive()
        # the first one ended: nothing of it is held any more
        wait_until(lambda: metric(base, "vllm_pd_kv_room_blocks", instance=d1) == 40)


def test_a_split_waits_for_room_when_configured(engines):
    engines["d1"].behavior.kv_blocks = 10
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 4}
    decision = {"cost_model": False, "decode_room": "wait", "decode_room_wait_s": 60}
    with proxy(engines, instances=fleet(engines, decode=("d1",)), decision=decision) as (
        base,
        _,
    ):
        wait_until(lambda: metric(base, "vllm_pd_kv_room_blocks", instance=engines["d1"].url))
        result: dict = {}
        waiter = threading.Thread(
            target=lambda: result.update(
                resp=httpx.post(f"{base}/v1/completions", json=body, timeout=60)
            )
        )
        waiter.start()
        wait_until(lambda: metric(base, "vllm_pd_room_waiting") == 1)
        assert waiter.is_alive() and not sent(engines["d1"])
        engines["d1"].behavior.kv_blocks = 1000  # room comes
        waiter.join(timeout=60)
        assert result["resp"].status_code == 200
        assert metric(base, "vllm_pd_room_waits_total", outcome="room") == 1
        assert metric(base, "vllm_pd_decisions_total", decision="split") == 1
        assert metric(base, "vllm_pd_decisions_total", reason="decode_full") == 0
        assert metric(base, "vllm_pd_room_waiting") == 0


def test_a_split_that_waited_too_long_runs_colocated(engines):
    engines["d1"].behavior.kv_blocks = 10
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 4}
    decision = {"cost_model": False, "decode_room": "wait", "decode_room_wait_s": 0.5}
    with proxy(engines, instances=fleet(engines, decode=("d1",)), decision=decision) as (
        base,
        _,
    ):
        wait_until(lambda: metric(base, "vllm_pd_kv_room_blocks", instance=engines["d1"].url))
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200
        assert metric(base, "vllm_pd_room_waits_total", outcome="timeout") == 1
        assert metric(base, "vllm_pd_decisions_total", reason="decode_full") == 1
        assert not sent(engines["p1"]) and not sent(engines["p2"])
