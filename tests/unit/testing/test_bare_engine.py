"""The benchmark's no-compute upstream answers in vLLM's wire format and scrapes as idle."""

from __future__ import annotations

import json

import httpx
import pytest

from vllm_pd_ext.testing.fake_engine import MODEL, BareEngine, ServerThread
from vllm_pd_ext.util.prom import parse_metrics


@pytest.fixture(scope="module")
def base():
    with ServerThread(BareEngine(token_interval_s=0.0)) as server:
        yield f"http://127.0.0.1:{server.port}"


def test_streams_one_event_per_token_then_done(base):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 5, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=10) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["text"] for c in chunks] == [f" t{i}" for i in range(5)]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["length"]
    assert {c["object"] for c in chunks} == {"text_completion"}


def test_chat_answers_one_json_body(base):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    data = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=10).json()
    assert data["object"] == "chat.completion"
    assert data["choices"][0]["message"] == {"role": "assistant", "content": " t0 t1 t2"}
    assert data["usage"]["completion_tokens"] == 3


def test_models_health_and_idle_metrics(base):
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200
    models = httpx.get(f"{base}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    metrics = parse_metrics(httpx.get(f"{base}/metrics", timeout=10).text)
    assert metrics.names() == {
        "vllm:cache_config_info",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
    }
    assert metrics.total("vllm:num_requests_running", model_name=MODEL) == 0
    assert httpx.get(f"{base}/nope", timeout=10).status_code == 404
