"""The benchmark's no-compute upstream answers in vLLM's wire format and scrapes as idle."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.conftest import requires_vllm
from vllm_pd_ext.testing.fake_engine import FAKE_TOKEN_ID, MODEL, BareEngine, ServerThread
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


HEAD = {"id", "object", "created", "model", "choices"}
CHAT_CHOICE = {"index", "delta", "logprobs", "finish_reason", "token_ids"}
COMPLETION_CHOICE = frozenset(
    {"index", "text", "logprobs", "finish_reason", "stop_reason", "prompt_token_ids", "token_ids"}
)


def _stream(base: str, route: str, body: dict) -> list[bytes]:
    with httpx.stream("POST", f"{base}{route}", json=body, timeout=10) as r:
        assert r.status_code == 200
        events = [line[6:].encode() for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == b"[DONE]"
    return events[:-1]


@requires_vllm
@pytest.mark.parametrize("ask", [True, False], ids=["ids", "no-ids"])
def test_a_completion_stream_is_vllms_byte_for_byte_token_ids_included(base, ask):
    from vllm.entrypoints.openai.completion.protocol import CompletionStreamResponse

    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3, "stream": True}
    events = _stream(base, "/v1/completions", body | ({"return_token_ids": True} if ask else {}))
    chunks = [CompletionStreamResponse.model_validate_json(e) for e in events]
    # vLLM writes each event as its model dumped with exclude_unset: the same bytes back
    assert [c.model_dump_json(exclude_unset=True).encode() for c in chunks] == events
    choices = [c.choices[0] for c in chunks]
    # the fields vLLM's completion serving sets on every streamed choice, null or not
    assert {frozenset(ch.model_fields_set) for ch in choices} == {COMPLETION_CHOICE}
    assert [ch.prompt_token_ids for ch in choices] == [[5, 6, 7] if ask else None, None, None]
    ids = [ch.token_ids for ch in choices]
    assert ids == ([[FAKE_TOKEN_ID + i] for i in range(3)] if ask else [None] * 3)


@requires_vllm
@pytest.mark.parametrize("ask", [True, False], ids=["ids", "no-ids"])
def test_a_chat_stream_is_vllms_byte_for_byte_role_event_and_token_ids_included(base, ask):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionStreamResponse

    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi there"}]}
    body |= {"max_tokens": 2, "stream": True} | ({"return_token_ids": True} if ask else {})
    events = _stream(base, "/v1/chat/completions", body)
    chunks = [ChatCompletionStreamResponse.model_validate_json(e) for e in events]
    assert [c.model_dump_json(exclude_unset=True).encode() for c in chunks] == events
    role, *tokens = chunks
    # the fields vLLM's chat serving sets: its role event, then a token's, then the last's
    assert role.model_fields_set == HEAD | {"prompt_token_ids", "prompt_text"}
    assert role.choices[0].model_fields_set == CHAT_CHOICE - {"token_ids"}
    assert [c.model_fields_set for c in tokens] == [HEAD, HEAD]
    assert [c.choices[0].model_fields_set for c in tokens] == [
        CHAT_CHOICE,
        CHAT_CHOICE | {"stop_reason"},
    ]
    assert role.choices[0].delta.role == "assistant"
    assert role.prompt_token_ids == ([1, _word_id("hi"), _word_id("there")] if ask else None)
    assert [c.choices[0].delta.content for c in tokens] == [" t0", " t1"]
    assert [c.prompt_token_ids for c in tokens] == [None, None]
    ids = [c.choices[0].token_ids for c in tokens]
    assert ids == ([[FAKE_TOKEN_ID], [FAKE_TOKEN_ID + 1]] if ask else [None, None])
    assert [c.choices[0].finish_reason for c in tokens] == [None, "length"]


def _word_id(word: str) -> int:
    return FAKE_TOKEN_ID + sum(word.encode()) % 30000
