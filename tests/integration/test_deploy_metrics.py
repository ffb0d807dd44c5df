"""Every metric the Grafana dashboard and the alert rules under deploy/ name is on the real
/metrics of the part that exports it: a token-mode stack (`vllm-pd up --mode token`: render
server, prefill and decode `vllm serve` with our connector over tcp, proxy) after split and
colocated streamed requests."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests import deploy_files
from tests.conftest import requires_vllm
from tests.integration.fleet_helpers import running_up
from vllm_pd_ext.tools.pd_demo import make_prompt_ids

pytestmark = [pytest.mark.integration, requires_vllm]

#: Which part exports a name, by its prefix (the first that matches).
OWNERS = (("vllm_pd_render_", "render"), ("vllm_pd_", "proxy"), ("vllm:", "engines"))
#: Names a part exports only after an event this stack does not provoke: each must still be
#: declared on that part's /metrics (its ``# TYPE`` line), and be used by the files.
ON_EVENT = {
    "vllm_pd_fallbacks_total": "labelled by reason; the first fallback adds its series",
    "vllm_pd_retries_total": "labelled by leg; the first retry adds its series",
    "vllm_pd_rejected_total": "labelled by reason; the first refusal adds its series",
    "vllm_pd_breaker_open": "labelled by pair; a pair's series appears when its stall breaker "
    "first opens",
    "vllm_pd_split_failures_total": "labelled by pair and reason; a pair's first failed split "
    "adds its series",
}
_SUFFIXES = ("_bucket", "_sum", "_count")


@pytest.fixture(scope="module")
def stack(model_cache, tiny_llama, tmp_path_factory) -> Iterator[dict[str, str]]:
    """A token-mode stack from `vllm-pd up`, its parts' URLs by name; stopped at the end."""
    args = ["--mode", "token", "--min-split-prompt-tokens", "32", "--no-cost-model"]
    with running_up(args, tmp_path_factory.mktemp("deploy-metrics"), model_cache) as up:
        assert set(up.parts) == {"render-0", "prefill-0", "decode-0"}, up.banner
        yield {**up.parts, "proxy": up.proxy, "model": up.model}


def _stream(url: str, body: dict) -> None:
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.read().decode().endswith("data: [DONE]\n\n")


def _exposition(url: str) -> tuple[set[str], set[str]]:
    """(sample names, declared family names) on ``url``'s /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    samples = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    declared = set(re.findall(r"^# TYPE (\S+) ", text, re.M))
    return samples, declared


def _engine_ids(url: str) -> list[str]:
    """The engine ids ``url``'s ``vllm:pdext_kv_engine_info`` names."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return [
        s.labels["engine_id"]
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "vllm:pdext_kv_engine_info" and s.value == 1
    ]


def _family(name: str) -> str:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


def test_every_dashboard_and_alert_metric_is_exported(stack, tiny_llama):
    proxy = f"{stack['proxy']}/v1/completions"
    prompt = make_prompt_ids(tiny_llama, 120)
    body = {"model": stack["model"], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    _stream(proxy, {**body, "prompt": prompt})  # split: prefill, KV transfer, decode
    _stream(proxy, {**body, "prompt": prompt[:3]})  # colocated

    exported: dict[str, tuple[set[str], set[str]]] = {
        "proxy": _exposition(stack["proxy"]),
        "render": _exposition(stack["render-0"]),
    }
    prefill, decode = _exposition(stack["prefill-0"]), _exposition(stack["decode-0"])
    exported["engines"] = (prefill[0] | decode[0], prefill[1] | decode[1])
    # the split request moved KV: the connector's histogram has an observation
    assert re.search(
        r"^vllm:pdext_kv_transfer_seconds_count\{.*\} [1-9]",
        httpx.get(f"{stack['decode-0']}/metrics", timeout=30).text,
        re.M,
    )

    # ... counted per peer under the prefill's engine id, which the prefill says is its own
    prefill_ids = _engine_ids(stack["prefill-0"])
    assert len(prefill_ids) == 1, prefill_ids
    assert re.search(
        rf'^vllm:pdext_kv_peer_bytes_total\{{.*peer="{re.escape(prefill_ids[0])}".*\}} [1-9]',
        httpx.get(f"{stack['decode-0']}/metrics", timeout=30).text,
        re.M,
    )

    names = deploy_files.all_metric_names()
    assert set(ON_EVENT) <= names, "ON_EVENT lists a name the files no longer use"
    missing = []
    for name in sorted(names):
        owner = next(part for prefix, part in OWNERS if name.startswith(prefix))
        samples, declared = exported[owner]
        if name in samples:
            continue
        if name in ON_EVENT and _family(name) in declared:
            continue
        missing.append(f"{name} (not on /metrics of the {owner})")
    assert missing == []
