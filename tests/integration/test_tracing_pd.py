"""Tracing on a real 1P1D stack (two `vllm serve` with NixlConnector on CPU, vLLM's own
tracing on): each request through the proxy is one trace, the proxy's spans for its stages
and legs, and each engine's span under the leg the proxy sent it, in text mode and in token
mode (our render server in front, the engines on --enable-scale-out). Then our connector's
pair (tcp backend), tracing too: its transfer spans sit under the proxy's legs."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import requires_nixl_pair
from tests.integration import fleet_helpers
from tests.integration.fleet_helpers import warm_up_split
from tests.skips import need
from tests.spans import OtlpCollector, request_trace
from vllm_pd_ext.proxy.app import create_app
from vllm_pd_ext.proxy.config import ProxyConfig
from vllm_pd_ext.proxy.tracing import Tracing
from vllm_pd_ext.render_server.app import create_app as create_render_app
from vllm_pd_ext.render_server.settings import RenderSettings
from vllm_pd_ext.testing.fake_engine import ServerThread
from vllm_pd_ext.tools.pd_demo import NIXL_CPU, make_prompt_ids
from vllm_pd_ext.util.vllm_process import free_port

pytestmark = pytest.mark.integration
#: The environment and `vllm serve` arguments of an engine that traces to ``collector``.
OTLP_HTTP = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}


@pytest.fixture(scope="module")
def collector() -> Iterator[OtlpCollector]:
    need("opentelemetry.sdk", why="the otel extra: spans to an in-memory exporter")
    collector = OtlpCollector()
    yield collector
    collector.close()


@pytest.fixture(scope="module")
def pair(vllm_servers, tiny_llama, collector):
    """A NIXL prefill and decode, both tracing to ``collector`` (vLLM's flag)."""
    servers = [
        vllm_servers.start(
            tiny_llama,
            name=f"tracing-{role}",
            wait=False,
            cpu_core=core,
            kv_transfer_config=NIXL_CPU,
            env={
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
            },
            extra_args=[
                "--no-enable-prefix-caching",
                "--enable-scale-out",
                "--otlp-traces-endpoint",
                collector.url,
            ],
        )
        for role, core in (("prefill", 0), ("decode", 1))
    ]
    for server in servers:
        server.wait_healthy()
    for server in servers:
        server.calm_idle_pollers()
    warm_up_split(servers[0], servers[1], tiny_llama)
    return servers[0], servers[1]


@pytest.fixture(scope="module")
def render_url(tiny_llama, pair) -> Iterator[str]:
    settings = RenderSettings(model=str(tiny_llama), served_model_name=pair[1].served_name)
    with ServerThread(create_render_app(settings)) as server:
        yield f"http://127.0.0.1:{server.port}"


def _engine_spans(
    collector: OtlpCollector, parent, timeout: float = 60.0, name: str | None = None
) -> list:
    """The spans (called ``name``, when given) the engines exported under the proxy's span
    ``parent`` (vLLM exports in batches: polled)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [
            s
            for s in list(collector.spans)
            if s.trace_id == parent.context.trace_id.to_bytes(16, "big")
            and s.parent_span_id == parent.context.span_id.to_bytes(8, "big")
            and (name is None or s.name == name)
        ]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


@requires_nixl_pair
@pytest.mark.parametrize("mode", ["text", "token"])
def test_each_request_is_one_trace_across_proxy_and_engines(
    pair, collector, render_url, tiny_llama, mode
):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    prefill, decode = pair
    exporter = InMemorySpanExporter()
    config = ProxyConfig.model_validate(
        {
            "instances": [
                {"url": prefill.base_url, "role": "prefill"},
                {"url": decode.base_url, "role": "decode"},
            ],
            "render": [render_url] if mode == "token" else [],
            "decision": {"min_split_prompt_tokens": 32, "cost_model": False},
        }
    )
    app = create_app(config, tracing=Tracing.to_exporter(exporter, batch=False))
    body = {
        "model": decode.served_name,
        "prompt": make_prompt_ids(tiny_llama, 120),
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    with ServerThread(app, http=app.server_protocol()) as server:
        url = f"http://127.0.0.1:{server.port}/v1/completions"
        whole = httpx.post(url, json=body, timeout=120)
        assert whole.status_code == 200, whole.text
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as resp:
            assert resp.status_code == 200
            text = resp.read().decode()
            assert text.endswith("data: [DONE]\n\n") and '"error"' not in text
            streamed = resp.headers["x-request-id"]
        traces = {
            "whole": request_trace(exporter, whole.headers["x-request-id"]),
            "stream": request_trace(exporter, streamed),
        }
    expected = {"request", "prefill", "decode"}
    if mode == "token":
        expected |= {"render", "derender"}
    for kind, spans in traces.items():
        assert expected <= set(spans), (kind, set(spans))
        (root,) = spans["request"]
        assert root.attributes["vllm_pd.decision"] == "split", kind
        assert root.attributes["vllm_pd.outcome"] == "ok", kind
        (prefill_span,) = spans["prefill"]
        assert prefill_span.attributes["server.address"] == prefill.base_url
        (decode_span,) = spans["decode"]
        assert decode_span.attributes["server.address"] == decode.base_url
        # vLLM's tracing continued the trace under each leg's span
        for leg in (prefill_span, decode_span):
            assert _engine_spans(collector, leg), (kind, leg.name)
    assert {"transfer_wait", "decode_stream"} <= set(traces["stream"])
    assert "decode_stream" not in traces["whole"]
    assert len({s.context.trace_id for s in exporter.get_finished_spans()}) == 2


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
    loads = _engine_spans(collector, decode_leg, name="kv_load")
    assert len(loads) == 1, [s.name for s in _engine_spans(collector, decode_leg)]
    load = _attributes(loads[0])
    assert load["vllm_pd.kv.outcome"] == "ok" and load["vllm_pd.kv.mode"] == "read"
    assert load["vllm_pd.kv.bytes"] > 0
    assert load["server.address"] == "127.0.0.1"
    (hold,) = _engine_spans(collector, prefill_leg, name="kv_hold")
    assert _attributes(hold)["vllm_pd.kv.outcome"] == "released"
