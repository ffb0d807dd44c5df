"""Tracing (``proxy/tracing.py``): one trace per request, a span per stage and leg, the legs'
``traceparent`` at the engines; nothing of it when off. Spans go to the SDK's in-memory
exporter; the engines are the fake ones, the render server (token mode) ours, in-process."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.skips import need
from tests.spans import request_trace, traceparent_of
from tests.unit.proxy.helpers import LONG, SHORT, proxy
from vllm_pd_ext.proxy.tracing import Tracing
from vllm_pd_ext.render_server.app import create_app as create_render_app
from vllm_pd_ext.render_server.settings import RenderSettings
from vllm_pd_ext.testing.fake_engine import Behavior, ServerThread

need(
    "opentelemetry.sdk",
    why="the otel extra: spans to an in-memory exporter",
    allow_module_level=True,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def tracing(exporter) -> Tracing:
    return Tracing.to_exporter(exporter, batch=False)


def _headers_at(engine) -> list[dict]:
    return [r["headers"] for r in engine.requests]


def _stream(base: str, body: dict, headers: dict | None = None) -> str:
    with httpx.stream(
        "POST", f"{base}/v1/completions", json={**body, "stream": True}, headers=headers, timeout=30
    ) as r:
        assert r.status_code == 200, r.read()
        r.read()
        return r.headers["x-request-id"]


def test_a_split_stream_is_one_trace_with_a_span_per_stage(engines, exporter, tracing):
    with proxy(engines, tracing=tracing) as (base, _):
        rid = _stream(base, {"model": "fake", "prompt": LONG, "max_tokens": 5})
        spans = request_trace(exporter, rid)
    assert {"request", "prefill", "decode", "transfer_wait", "decode_stream"} <= set(spans)
    assert {s.context.trace_id for s in exporter.get_finished_spans()} == {
        spans["request"][0].context.trace_id
    }
    (root,) = spans["request"]
    assert root.attributes["vllm_pd.decision"] == "split"
    assert root.attributes["vllm_pd.reason"] == "split"
    assert root.attributes["vllm_pd.outcome"] == "ok"
    (prefill,) = spans["prefill"]
    (decode,) = spans["decode"]
    assert prefill.attributes["http.response.status_code"] == 200
    assert [e.name for e in decode.events] == ["first_token"]
    # each engine got its own leg's span as the parent of whatever it traces
    by_url = {e.url: e for e in engines.values()}
    (p_headers,) = _headers_at(by_url[prefill.attributes["server.address"]])
    (d_headers,) = _headers_at(by_url[decode.attributes["server.address"]])
    assert p_headers["traceparent"] == traceparent_of(prefill)
    assert d_headers["traceparent"] == traceparent_of(decode)
    (wait,), (stream,) = spans["transfer_wait"], spans["decode_stream"]
    assert prefill.end_time <= wait.start_time <= wait.end_time <= stream.start_time
    assert stream.end_time <= root.end_time


def test_a_short_whole_request_is_served_colocated_in_one_decode_span(engines, exporter, tracing):
    with proxy(engines, tracing=tracing) as (base, _):
        resp = httpx.post(
            f"{base}/v1/completions", json={"model": "fake", "prompt": SHORT, "max_tokens": 3}
        )
        assert resp.status_code == 200, resp.text
        spans = request_trace(exporter, resp.headers["x-request-id"])
    assert set(spans) == {"request", "decode"}
    (root,) = spans["request"]
    assert root.attributes["vllm_pd.decision"] == "colocated"
    assert root.attributes["vllm_pd.reason"] == "short_prompt"


def test_a_failed_prefill_shows_as_failed_legs_and_a_fallback_event(engines, exporter, tracing):
    for name in ("p1", "p2"):
        engines[name].behavior.status = 503
    with proxy(engines, tracing=tracing) as (base, _):
        rid = _stream(base, {"model": "fake", "prompt": LONG, "max_tokens": 3})
        spans = request_trace(exporter, rid)
    assert len(spans["prefill"]) == 2  # one retry
    assert all(s.attributes["error.type"] == "HTTP 503" for s in spans["prefill"])
    (root,) = spans["request"]
    (event,) = [e for e in root.events if e.name == "fallback"]
    assert event.attributes["vllm_pd.reason"] == "prefill_failed"
    assert root.attributes["vllm_pd.decision"] == "colocated"
    assert root.attributes["vllm_pd.outcome"] == "ok"
    assert "transfer_wait" not in spans


def test_a_retried_decode_leg_ends_in_error_and_the_next_one_serves(engines, exporter, tracing):
    engines["d1"].behavior.status = 500
    with proxy(engines, tracing=tracing, decode_policy="round-robin") as (base, _):
        resp = httpx.post(
            f"{base}/v1/completions", json={"model": "fake", "prompt": SHORT, "max_tokens": 3}
        )
        assert resp.status_code == 200, resp.text
        spans = request_trace(exporter, resp.headers["x-request-id"])
    first, second = sorted(spans["decode"], key=lambda s: s.attributes["vllm_pd.attempt"])
    assert first.attributes["error.type"] == "retried"
    assert first.attributes["server.address"] == engines["d1"].url
    assert "error.type" not in second.attributes


def test_a_clients_traceparent_makes_the_request_span_its_child(engines, exporter, tracing):
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with proxy(engines, tracing=tracing) as (base, _):
        rid = _stream(
            base, {"model": "fake", "prompt": SHORT, "max_tokens": 2}, {"traceparent": parent}
        )
        spans = request_trace(exporter, rid)
    (root,) = spans["request"]
    assert root.context.trace_id == 0x0AF7651916CD43DD8448EB211C80319C
    assert root.parent is not None and root.parent.span_id == 0xB7AD6B7169203331


def test_with_tracing_off_no_engine_gets_a_traceparent(engines):
    with proxy(engines) as (base, service):
        assert service.tracing is None
        _stream(base, {"model": "fake", "prompt": LONG, "max_tokens": 3})
    sent = [h for e in engines.values() for h in _headers_at(e)]
    assert sent and not any("traceparent" in h for h in sent)


@pytest.fixture(scope="module")
def render_url(tiny_llama) -> Iterator[str]:
    settings = RenderSettings(model=str(tiny_llama), served_model_name="fake")
    with ServerThread(create_render_app(settings)) as server:
        yield f"http://127.0.0.1:{server.port}"


@pytest.mark.parametrize("stream", [False, True])
def test_token_mode_adds_render_and_derender(engines, exporter, tracing, render_url, stream):
    body = {"model": "fake", "prompt": LONG, "max_tokens": 4}
    with proxy(engines, tracing=tracing, render=[render_url]) as (base, _):
        if stream:
            rid = _stream(base, body)
        else:
            resp = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
            assert resp.status_code == 200, resp.text
            rid = resp.headers["x-request-id"]
        spans = request_trace(exporter, rid)
    assert {"request", "render", "prefill", "decode", "derender"} <= set(spans)
    (render,) = spans["render"]
    (prefill,) = spans["prefill"]
    assert render.attributes["vllm_pd.prompt_tokens"] > 0
    assert render.end_time <= prefill.start_time
    assert ("decode_stream" in spans) is stream
    (derender,) = spans["derender"]
    if stream:
        assert derender.attributes["vllm_pd.mode"] == "stream"


def test_a_migrated_stream_is_a_migration_event_and_its_continuation_joins_the_trace(
    engines, exporter, tracing
):
    """A decode that breaks mid-stream: the request span gets a ``migration`` event (from,
    to, after how many tokens) and the continuation's engine gets the request's trace."""
    engines["d1"].behavior = engines["d2"].behavior = Behavior(die_after_tokens=3, die_once=True)
    with proxy(engines, tracing=tracing, max_migrations=1) as (base, _):
        rid = _stream(base, {"model": "fake", "prompt": SHORT, "max_tokens": 8})
        spans = request_trace(exporter, rid)
    (root,) = spans["request"]
    (event,) = [e for e in root.events if e.name == "migration"]
    assert event.attributes["vllm_pd.outcome"] == "continued"
    assert event.attributes["vllm_pd.after_tokens"] == 3
    assert event.attributes["vllm_pd.from"] != event.attributes["vllm_pd.to"]
    continued = [
        h
        for engine in engines.values()
        for h in _headers_at(engine)
        if h.get("x-request-id", "").endswith("-m1")
    ]
    assert len(continued) == 1
    assert continued[0]["traceparent"] == traceparent_of(root)
