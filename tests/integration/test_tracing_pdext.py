"""Our connector's KV transfer spans on a real pair (tcp backend, vLLM's tracing on): a split
stream through the proxy, and the engines' ``kv_load``/``kv_hold`` under the proxy's legs.
Its own module so that no other module's engines are still up while its pair starts."""

from __future__ import annotations

import httpx
import pytest

from tests.integration import fleet_helpers
from tests.spans import OTLP_HTTP, engine_spans, request_trace
from vllm_pd_ext.proxy.app import create_app
from vllm_pd_ext.proxy.config import ProxyConfig
from vllm_pd_ext.proxy.tracing import Tracing
from vllm_pd_ext.testing.fake_engine import ServerThread
from vllm_pd_ext.tools.pd_demo import make_prompt_ids

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pdext_pair(vllm_servers, tiny_qwen, collector):
    """Our connector over tcp on a prefill and a decode, both tracing to ``collector``."""
    return fleet_helpers.pdext_pair(
        vllm_servers,
        tiny_qwen,
        "tracing-pdext",
        backend="tcp",
        env=OTLP_HTTP,
        extra_args=["--otlp-traces-endpoint", collector.url],
    )


def _attributes(span) -> dict:
    """An OTLP span's attributes as a dict."""
    return {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in span.attributes}


def test_our_connectors_transfer_spans_sit_under_the_proxys_legs(pdext_pair, collector, tiny_qwen):
    """A split stream through the proxy (pdext-read): the decode engine's ``kv_load`` (the
    bytes it read, ok) is a child of the proxy's decode leg, the prefill engine's
    ``kv_hold`` (released by the decode) of its prefill leg: the engines' connector saw
    each request's traceparent, in EngineCore and in the worker."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    prefill, decode, _side = pdext_pair
    exporter = InMemorySpanExporter()
    config = ProxyConfig.model_validate(
        {
            "instances": [
                {"url": prefill.base_url, "role": "prefill"},
                {"url": decode.base_url, "role": "decode"},
            ],
            "protocol": "pdext-read",
            "decision": {"min_split_prompt_tokens": 32, "cost_model": False},
            "stall_guard": {"hedge": False},  # the split's spans: no colocated leg beside it
        }
    )
    app = create_app(config, tracing=Tracing.to_exporter(exporter, batch=False))
    body = {
        "model": decode.served_name,
        "prompt": make_prompt_ids(tiny_qwen, 120),
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with ServerThread(app, http=app.server_protocol()) as server:
        url = f"http://127.0.0.1:{server.port}/v1/completions"
        with httpx.stream("POST", url, json=body, timeout=120) as resp:
            assert resp.status_code == 200
            text = resp.read().decode()
            assert text.endswith("data: [DONE]\n\n") and '"error"' not in text
            spans = request_trace(exporter, resp.headers["x-request-id"])
    (root,) = spans["request"]
    assert root.attributes["vllm_pd.decision"] == "split"
    (prefill_leg,) = spans["prefill"]
    (decode_leg,) = spans["decode"]
    loads = engine_spans(collector, decode_leg, name="kv_load")
    assert len(loads) == 1, [s.name for s in engine_spans(collector, decode_leg)]
    load = _attributes(loads[0])
    assert load["vllm_pd.kv.outcome"] == "ok" and load["vllm_pd.kv.mode"] == "read"
    assert load["vllm_pd.kv.bytes"] > 0
    assert load["server.address"] == "127.0.0.1"
    (hold,) = engine_spans(collector, prefill_leg, name="kv_hold")
    assert _attributes(hold)["vllm_pd.kv.outcome"] == "released"
