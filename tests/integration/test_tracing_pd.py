"""Tracing on a real 1P1D stack (two `vllm serve` with NixlConnector on CPU, vLLM's own
tracing on): each request through the proxy is one trace, the proxy's spans for its stages
and legs, and each engine's span under the leg the proxy sent it, in text mode and in token
mode (our render server in front, the engines on --enable-scale-out). Our connector's
transfer spans: test_tracing_pdext.py (its own module, so that this one's engines are
stopped before its pair starts)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import requires_nixl_pair
from tests.integration.fleet_helpers import warm_up_split
from tests.spans import engine_spans, request_trace
from vllm_pd_ext.proxy.app import create_app
from vllm_pd_ext.proxy.config import ProxyConfig
from vllm_pd_ext.proxy.tracing import Tracing
from vllm_pd_ext.render_server.app import create_app as create_render_app
from vllm_pd_ext.render_server.settings import RenderSettings
from vllm_pd_ext.testing.fake_engine import ServerThread
from vllm_pd_ext.tools.pd_demo import NIXL_CPU, make_prompt_ids
from vllm_pd_ext.util.vllm_process import free_port

pytestmark = pytest.mark.integration


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
            "stall_guard": {"hedge": False},  # the split's spans: no colocated leg beside it
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
            assert engine_spans(collector, leg), (kind, leg.name)
    assert {"transfer_wait", "decode_stream"} <= set(traces["stream"])
    assert "decode_stream" not in traces["whole"]
    assert len({s.context.trace_id for s in exporter.get_finished_spans()}) == 2
