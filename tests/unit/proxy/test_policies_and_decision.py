"""Routing policies, the split decision and config validation, in isolation."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from pydantic import ValidationError

from vllm_pd_ext.proxy.config import DecisionConfig, ProxyConfig, read_instances
from vllm_pd_ext.proxy.decision import Decider
from vllm_pd_ext.proxy.kv_events import Lookup
from vllm_pd_ext.proxy.policies import make_policy
from vllm_pd_ext.proxy.policies.power_of_two import PowerOfTwo
from vllm_pd_ext.proxy.request import RequestContext


@dataclass(eq=False)
class Node:
    url: str
    busy: float = 0.0
    running: float = 0.0
    waiting: float = 0.0
    in_flight: int = 0
    kv_usage: float = 0.0
    failures: int = 0

    def load(self) -> float:
        return self.busy

    def cached_tokens(self, prompt: Lookup) -> int | None:
        return None  # no prefix index (these policies do not look)


def nodes(n: int) -> list[Node]:
    return [Node(f"http://10.0.0.{i}:8000") for i in range(n)]


def test_round_robin_cycles():
    policy, pool = make_policy("round-robin"), nodes(3)
    assert [policy.select("k", pool).url for _ in range(6)] == [n.url for n in pool] * 2


def test_least_loaded_picks_min_and_rotates_ties():
    policy, pool = make_policy("least-loaded"), nodes(3)
    pool[0].busy, pool[1].busy, pool[2].busy = 5, 1, 1
    picks = {policy.select("k", pool).url for _ in range(4)}
    assert picks == {pool[1].url, pool[2].url}


def test_power_of_two_never_picks_the_busiest_of_its_pair():
    policy, pool = PowerOfTwo(seed=7), nodes(2)
    pool[0].busy = 10
    assert all(policy.select("k", pool) is pool[1] for _ in range(20))


def test_prefix_affinity_is_sticky_spread_and_consistent():
    policy, pool = make_policy("prefix-affinity"), nodes(4)
    keys = [f"system prompt {i}" for i in range(200)]
    first = {k: policy.select(k, pool).url for k in keys}
    assert all(policy.select(k, pool).url == first[k] for k in keys)  # sticky
    assert len(set(first.values())) == 4  # spread over the fleet
    removed = pool[0].url
    after = {k: policy.select(k, pool[1:]).url for k in keys}
    moved = [k for k in keys if first[k] != after[k]]
    assert all(first[k] == removed for k in moved)  # only the removed node's keys move


def test_prefix_affinity_avoids_an_overloaded_owner():
    policy, pool = make_policy("prefix-affinity"), nodes(3)
    owner = policy.select("hot prefix", pool)
    owner.busy = 100
    assert policy.select("hot prefix", pool) is not owner


def ctx(tokens: int, splittable: bool = True) -> RequestContext:
    return RequestContext(
        route="completions",
        body={},
        request_id="r",
        stream=False,
        est_prompt_tokens=tokens,
        affinity_key="",
        splittable=splittable,
    )


def test_decision_rules_in_order():
    decider = Decider(
        DecisionConfig(min_split_prompt_tokens=100, max_prefill_waiting=4, cost_min_samples=2)
    )
    p, d = Node("p"), Node("d")
    assert decider.decide(ctx(500, splittable=False), [p], d).reason == "not_splittable"
    assert decider.decide(ctx(500), [], d).reason == "no_prefill"
    assert decider.decide(ctx(50), [p], d).reason == "short_prompt"
    p.waiting = 4
    assert decider.decide(ctx(500), [p], d).reason == "prefill_overloaded"
    p.waiting = 0
    assert decider.decide(ctx(500), [p], d).split  # no measurements yet
    for _ in range(2):  # transfer 1 ms/token, prefill 2 ms/token
        decider.observe(1000, prefill_s=2.0, transfer_gap_s=1.0)
    d.running = 0
    decision = decider.decide(ctx(500), [p], d)
    assert (decision.split, decision.reason) == (False, "transfer_cost")  # idle decode
    d.running = 3  # a 1 s prefill would stall 3 running requests: worth the 0.5 s transfer
    decision = decider.decide(ctx(500), [p], d)
    assert decision.split and decision.inputs["stall_cost_s"] == pytest.approx(3.0)


def test_cost_model_can_be_disabled():
    decider = Decider(
        DecisionConfig(min_split_prompt_tokens=1, cost_model=False, cost_min_samples=1)
    )
    decider.observe(100, prefill_s=0.01, transfer_gap_s=10.0)
    assert decider.decide(ctx(500), [Node("p")], Node("d")).split


def test_config_validation_names_the_problem(tmp_path):
    with pytest.raises(ValidationError, match="no instances"):
        ProxyConfig()
    with pytest.raises(ValidationError, match="http://"):
        ProxyConfig(instances=[{"url": "10.0.0.1:8000"}])
    with pytest.raises(ValidationError, match="unknown policy 'fastest'"):
        ProxyConfig(instances=[{"url": "http://a"}], decode_policy="fastest")
    with pytest.raises(ValidationError, match="extra"):
        ProxyConfig(instances=[{"url": "http://a"}], retires=3)  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        ProxyConfig(instances=[{"url": "http://a", "role": "router"}])
    path = tmp_path / "fleet.yaml"
    path.write_text("instances:\n  - {url: 'http://p:1/', role: prefill}\n  - url: http://d:2\n")
    assert [(i.url, i.role) for i in read_instances(path)] == [
        ("http://p:1", "prefill"),
        ("http://d:2", "both"),
    ]
