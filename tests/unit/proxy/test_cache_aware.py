"""Cache-aware routing: the ``cache-aware`` policy's scoring and the split decision on the
prompt's non-cached tokens, over real fleet instances whose prefix indexes are fed by vLLM's
own KV event classes (through its wire encoding), and through a whole proxy whose instances
follow vLLM's own ZeroMQ publisher."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import requires_vllm
from tests.unit.proxy.helpers import fleet, metric, proxy, sent, wait_until
from tests.unit.proxy.test_kv_events import BLOCK, _vllm, block, stored
from vllm_pd_ext.proxy.config import DecisionConfig, InstanceConfig, ProxyConfig
from vllm_pd_ext.proxy.decision import Decider
from vllm_pd_ext.proxy.fleet import Instance
from vllm_pd_ext.proxy.kv_events import Lookup, PrefixIndex, Subscriber
from vllm_pd_ext.proxy.policies import ScoringConfig, make_policy
from vllm_pd_ext.proxy.policies.prefix_affinity import PrefixAffinity
from vllm_pd_ext.proxy.request import RequestContext
from vllm_pd_ext.proxy.routing import lookup_of
from vllm_pd_ext.proxy.upstream import Upstream

pytestmark = requires_vllm

#: A 40-token prompt: ten blocks of BLOCK (4) tokens.
PROMPT = list(range(1000, 1040))


def instance(name: str, events: bool = True) -> Instance:
    url = f"http://{name}:8000"
    config = InstanceConfig(url=url, role="decode", name=name)
    inst = Instance(config, Upstream(url, max_connections=1))
    inst.healthy = True
    if events:  # a subscriber never started: the test feeds its index
        inst.events = Subscriber(PrefixIndex(), f"ipc:///nonexistent/{name}")
    return inst


def holds(inst: Instance, tokens: list[int], salt: str | None = None) -> None:
    """``inst``'s engine stored ``tokens``' full blocks (one BlockStored, as vLLM sends it)."""
    assert inst.events is not None
    n = len(tokens) // BLOCK
    hashes = [f"{inst.label}-{i}".encode() for i in range(n)]
    extras = [(salt,) if salt and i == 0 else None for i in range(n)]
    inst.events.index.apply(stored(hashes, None, tokens[: n * BLOCK], extras))


def test_the_prompt_goes_where_its_prefix_is_cached_and_the_longest_prefix_wins():
    a, b, c = instance("a"), instance("b"), instance("c")
    holds(a, PROMPT[:8])
    holds(b, PROMPT[:32])
    policy = make_policy("cache-aware")
    prompt = Lookup(PROMPT)
    assert (a.cached_tokens(prompt), b.cached_tokens(prompt), c.cached_tokens(prompt)) == (
        8,
        32,
        0,
    )
    assert all(policy.select("k", [a, b, c], prompt) is b for _ in range(6))
    other = Lookup(list(range(5000, 5040)))  # cached nowhere: ties rotate over all three
    assert {policy.select("k", [a, b, c], other).label for _ in range(6)} == {"a", "b", "c"}


def test_the_salt_is_part_of_the_prefix():
    a, b = instance("a"), instance("b")
    holds(a, PROMPT, salt="tenant-1")
    holds(b, PROMPT)
    policy = make_policy("cache-aware")
    assert policy.select("k", [a, b], Lookup(PROMPT, "tenant-1")) is a
    assert policy.select("k", [a, b], Lookup(PROMPT)) is b
    assert a.cached_tokens(Lookup(PROMPT, "tenant-2")) == 0


def test_load_kv_usage_and_health_weigh_against_the_cache():
    holder, idle = instance("holder"), instance("idle")
    holds(holder, PROMPT[:8])  # a fifth of the prompt
    policy = make_policy("cache-aware", ScoringConfig(load_half=4.0))
    prompt = Lookup(PROMPT)
    assert policy.select("k", [holder, idle], prompt) is holder
    holder.running = 1.0  # 0.2 cached - 0.2 load: a tie at best
    holder.waiting = 1.0  # load 3: -0.43
    assert policy.select("k", [holder, idle], prompt) is idle
    holds(holder, PROMPT)  # all of it cached now: 1.0 - 0.43
    assert policy.select("k", [holder, idle], prompt) is holder
    holder.kv_usage = 0.9  # - 0.45: 0.12, still ahead of idle's 0
    assert policy.select("k", [holder, idle], prompt) is holder
    holder.failures = 1  # its last health check failed: - 1.0
    assert policy.select("k", [holder, idle], prompt) is idle
    heavy = make_policy("cache-aware", ScoringConfig(kv_usage_weight=2.0))
    holder.failures = 0
    assert heavy.select("k", [holder, idle], prompt) is idle  # 1.0 - 0.43 - 1.8


def test_instances_without_events_fall_back_to_the_estimate():
    a, b = instance("a", events=False), instance("b", events=False)
    assert a.cache_view == "estimate" and a.cached_tokens(Lookup(PROMPT)) is None
    estimate = PrefixAffinity()
    policy = make_policy("cache-aware")
    keys = [f"system prompt {i}" for i in range(40)]
    for key in keys:  # nobody has an index: exactly the prefix-affinity choice
        assert policy.select(key, [a, b], Lookup(PROMPT)) is estimate.select(key, [a, b])
    # one instance with an index that holds nothing, one without: the estimate's owner among
    # those without is credited half the prompt (estimate_credit)
    c = instance("c")
    assert c.cache_view == "events"
    for key in keys:
        owner = estimate.select(key, [a, b])
        assert policy.select(key, [a, b, c], Lookup(PROMPT)) is owner
    holds(c, PROMPT[:24])  # 60% cached beats the estimate's 50%
    assert all(policy.select(k, [a, b, c], Lookup(PROMPT)) is c for k in keys)
    c.events.failed = True  # type: ignore[union-attr]  # a failed subscription: the estimate
    assert c.cache_view == "estimate" and c.cached_tokens(Lookup(PROMPT)) is None


def test_text_prompts_are_routed_on_the_estimate():
    a, b = instance("a"), instance("b")
    holds(a, PROMPT)
    policy, estimate = make_policy("cache-aware"), PrefixAffinity()
    for key in (f"key {i}" for i in range(20)):
        assert policy.select(key, [a, b]) is estimate.select(key, [a, b])


def request(body: dict, route="completions") -> RequestContext:
    return RequestContext(
        route=route,
        body=body,
        request_id="r",
        stream=False,
        est_prompt_tokens=len(body.get("prompt") or []),
        affinity_key="",
        splittable=True,
    )


def test_token_ids_come_from_a_token_prompt_or_the_render_tier():
    from vllm_pd_ext.proxy.token_mode import TokenRequest

    found = lookup_of(request({"prompt": PROMPT, "cache_salt": "s"}))
    assert found is not None and list(found.token_ids) == PROMPT and found.cache_salt == "s"
    assert lookup_of(request({"prompt": "text"})) is None
    assert lookup_of(request({"prompt": [[1, 2], [3]]})) is None  # a batch of prompts
    assert lookup_of(request({"messages": [{"content": "hi"}]}, route="chat")) is None
    rendered = request({"messages": [{"content": "hi"}]}, route="chat")
    rendered.tokens = TokenRequest({"token_ids": PROMPT, "cache_salt": "t"}, PROMPT, "chatcmpl-1")
    found = lookup_of(rendered)
    assert found is not None and list(found.token_ids) == PROMPT and found.cache_salt == "t"


def test_a_prompt_mostly_cached_on_the_decode_instance_runs_there_colocated():
    decider = Decider(DecisionConfig(min_split_prompt_tokens=16, cost_model=False))
    p, d = instance("p"), instance("d")
    holds(d, PROMPT[:28])
    long = request({"prompt": PROMPT})
    cached = d.cached_tokens(Lookup(PROMPT))
    assert cached == 28
    decision = decider.decide(long, [p], d, cached)  # 12 tokens left to compute: < 16
    assert (decision.split, decision.reason) == (False, "cached_on_decode")
    assert decision.inputs["decode_cached_tokens"] == 28
    holds(d, PROMPT[:20])  # the same blocks: nothing changes
    less = d.cached_tokens(Lookup(PROMPT[:8] + list(range(8, 40))))  # diverges after 2 blocks
    decision = decider.decide(long, [p], d, less)  # 32 left: worth a split
    assert less == 8 and decision.split
    assert decider.decide(long, [p], d, None).split  # not known: the prompt's length decides
    assert decider.decide(request({"prompt": PROMPT[:12]}), [p], d, 12).reason == "short_prompt"


def test_the_proxy_routes_on_its_instances_kv_events(engines, tmp_path):
    """A proxy whose two decode instances follow vLLM's own publishers: a token prompt goes to
    the decode instance whose events say it holds the prompt, colocated there when most of it
    is cached (decision reason cached_on_decode), split when not; a text prompt is routed on
    the estimate (counted); /metrics says each instance's cache view."""
    kv = _vllm()
    publishers = {}
    instances = fleet(engines, prefill=("p1",), decode=("d1", "d2"))
    for inst, name in zip(instances[1:], ("d1", "d2"), strict=True):
        endpoint, replay = f"ipc://{tmp_path}/{name}", f"ipc://{tmp_path}/{name}-replay"
        publishers[name] = kv.ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay)
        inst["kv_events"] = {"endpoint": endpoint, "replay_endpoint": replay}
    d2 = engines["d2"].url
    prompt = [7] * 4 + list(range(2000, 2296))  # 300 tokens: 75 blocks
    events = [
        block([f"b{i}".encode()], f"b{i - 1}".encode() if i else None, prompt[i * 4 : i * 4 + 4])
        for i in range(75)
    ]
    publishers["d2"].publish(kv.KVEventBatch(ts=1.0, events=events))
    try:
        with proxy(
            engines,
            instances=instances,
            decode_policy="cache-aware",
            prefill_policy="cache-aware",
            decision={"cost_model": False, "min_split_prompt_tokens": 64},
        ) as (base, _svc):
            wait_until(
                lambda: metric(base, "vllm_pd_kv_events", instance=d2, figure="blocks") == 75
            )
            model = {"model": "m", "max_tokens": 4}
            cached = {**model, "prompt": [*prompt, *range(9000, 9040)]}  # 40 tokens not cached
            for _ in range(3):
                assert httpx.post(f"{base}/v1/completions", json=cached).status_code == 200
            assert len(sent(engines["d2"])) == 3 and not sent(engines["d1"])
            assert not sent(engines["p1"])
            assert metric(base, "vllm_pd_decisions_total", reason="cached_on_decode") == 3
            fresh = {**model, "prompt": list(range(3000, 3300))}  # cached nowhere: split
            assert httpx.post(f"{base}/v1/completions", json=fresh).status_code == 200
            assert metric(base, "vllm_pd_decisions_total", decision="split") == 1
            assert len(sent(engines["p1"])) == 1
            text = {**model, "prompt": "word " * 100}
            assert httpx.post(f"{base}/v1/completions", json=text).status_code == 200
            assert metric(base, "vllm_pd_prefix_lookups_total", basis="events") == 4
            assert metric(base, "vllm_pd_prefix_lookups_total", basis="no_token_ids") == 1
            p1 = engines["p1"].url
            assert metric(base, "vllm_pd_cache_view", instance=d2, view="events") == 1
            assert metric(base, "vllm_pd_cache_view", instance=p1, view="estimate") == 1
            assert metric(base, "vllm_pd_cache_view", instance=p1, view="events") == 0
    finally:
        for publisher in publishers.values():
            publisher.shutdown()


def test_scoring_weights_are_validated():
    with pytest.raises(ValueError, match="extra"):
        ProxyConfig(instances=[{"url": "http://a"}], scoring={"cache_wieght": 2})
    with pytest.raises(ValueError):
        ScoringConfig(estimate_credit=2)
    config = ProxyConfig(instances=[{"url": "http://a"}], decode_policy="cache-aware")
    assert config.scoring == ScoringConfig()


def test_a_text_prompt_is_looked_up_by_the_proxys_tokenizer(engines, tmp_path, tiny_llama):
    """Text mode with ``tokenizer``: a text completion's prompt is made ids as vLLM makes them
    (the model's tokenizer, special tokens added) and routed on the decode instances' KV
    events; a chat (its template is the engine's) still goes on the estimate."""
    from transformers import AutoTokenizer

    kv = _vllm()
    instances = fleet(engines, prefill=("p1",), decode=("d1", "d2"))
    endpoint, replay = f"ipc://{tmp_path}/d2", f"ipc://{tmp_path}/d2-replay"
    publisher = kv.ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay)
    instances[2]["kv_events"] = {"endpoint": endpoint, "replay_endpoint": replay}
    text = "the quick brown fox jumps over the lazy dog " * 30
    ids = AutoTokenizer.from_pretrained(tiny_llama)(text)["input_ids"]  # what vLLM sends
    n = len(ids) // BLOCK
    events = [
        block([f"t{i}".encode()], f"t{i - 1}".encode() if i else None, ids[i * 4 : i * 4 + 4])
        for i in range(n)
    ]
    publisher.publish(kv.KVEventBatch(ts=1.0, events=events))
    d2 = engines["d2"].url
    try:
        with proxy(
            engines,
            instances=instances,
            decode_policy="cache-aware",
            prefill_policy="cache-aware",
            tokenizer=str(tiny_llama),
            decision={"cost_model": False, "min_split_prompt_tokens": 64},
        ) as (base, _svc):
            wait_until(lambda: metric(base, "vllm_pd_kv_events", instance=d2, figure="blocks") == n)
            body = {"model": "m", "max_tokens": 4, "prompt": text}
            for _ in range(2):
                assert httpx.post(f"{base}/v1/completions", json=body).status_code == 200
            assert len(sent(engines["d2"])) == 2 and not sent(engines["d1"])
            assert metric(base, "vllm_pd_decisions_total", reason="cached_on_decode") == 2
            assert metric(base, "vllm_pd_prefix_lookups_total", basis="events") == 2
            chat = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": text}]}
            assert httpx.post(f"{base}/v1/chat/completions", json=chat).status_code == 200
            assert metric(base, "vllm_pd_prefix_lookups_total", basis="no_token_ids") == 1
    finally:
        publisher.shutdown()


def test_a_tokenizer_without_tokenizer_json_is_a_configuration_error(tmp_path):
    with pytest.raises(ValueError, match=r"no tokenizer\.json"):
        ProxyConfig(instances=[{"url": "http://a"}], tokenizer=tmp_path)
