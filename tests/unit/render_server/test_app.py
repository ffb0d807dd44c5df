"""The render server in-process (FastAPI TestClient) on tiny-qwen: routes, errors, streaming."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.unit.render_server.helpers import derender_chat_stream
from vllm_pd_ext.render_server.app import create_app
from vllm_pd_ext.render_server.settings import RenderSettings

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def client(tiny_qwen):
    app = create_app(RenderSettings(model=str(tiny_qwen), max_model_len=512, max_body_bytes=65536))
    with TestClient(app) as c:
        yield c


@pytest.fixture(scope="module")
def parser_client(tiny_qwen_think):
    settings = RenderSettings(
        model=str(tiny_qwen_think),
        reasoning_parser="deepseek_r1",
        tool_call_parser="hermes",
        enable_auto_tool_choice=True,
    )
    with TestClient(create_app(settings)) as c:
        yield c


def _ids(client, text: str) -> list[int]:
    out = client.post("/v1/completions/render", json={"prompt": text, "add_special_tokens": False})
    assert out.status_code == 200, out.text
    return out.json()[0]["token_ids"]


def test_chat_render_chatml_ids_and_defaults(client):
    resp = client.post(
        "/v1/chat/completions/render",
        json={"messages": [{"role": "user", "content": "Hi there ü"}]},
        headers={"X-Request-Id": "abc"},
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["request_id"] == "chatcmpl-abc"
    ids = body["token_ids"]
    assert ids[0] == 151644 and ids[-3:] == [151644, 77091, 198]  # <|im_start|>assistant\n
    sp = body["sampling_params"]
    assert sp["max_tokens"] == 512 - len(ids)
    assert sp["output_kind"] == 2 and sp["stop"] == [] and sp["temperature"] == 1.0


def test_chat_render_greedy_params_and_logprobs(client):
    body = client.post(
        "/v1/chat/completions/render",
        json={
            "messages": [{"role": "user", "content": "x"}],
            "temperature": 0,
            "max_tokens": 7,
            "logprobs": True,
            "top_logprobs": 3,
            "stop": "abc",
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ).json()
    sp = body["sampling_params"]
    assert sp["temperature"] == 0.0 and "top_p" not in sp and "top_k" not in sp
    assert sp["logprobs"] == 3 and sp["max_tokens"] == 7 and sp["stop"] == ["abc"]
    assert sp["output_text_buffer_length"] == 2 and sp["output_kind"] == 1
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}


def test_completion_render_token_prompts_and_batch(client):
    resp = client.post("/v1/completions/render", json={"prompt": [[1, 2, 3], [4, 5]]})
    assert resp.status_code == 200
    items = resp.json()
    assert [i["token_ids"] for i in items] == [[1, 2, 3], [4, 5]]
    assert items[0]["request_id"].endswith("-0") and items[1]["request_id"].endswith("-1")
    assert "max_tokens" not in items[0]["sampling_params"]  # default 16 is omitted like vLLM


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"messages": [{"role": "user", "content": "word " * 600}]}, "maximum context length"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": 5}, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": TOOLS}, "auto"),
        ({"messages": "nope"}, "messages"),
        ({"prompt": []}, None),
    ],
)
def test_client_mistakes_are_400_with_openai_body(client, body, fragment):
    route = "/v1/completions/render" if "prompt" in body else "/v1/chat/completions/render"
    resp = client.post(route, json=body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["code"] == 400 and err["type"]
    if fragment:
        assert fragment in err["message"]


@pytest.mark.parametrize(
    ("xargs", "fragment"),
    [
        ({"kv_transfer_params": {"do_remote_prefill": True, "remote_port": 9}}, "steers KV"),
        ({"ec_transfer_params": "x"}, "steers KV"),
        ({"deep": {"nested": 1}}, "vllm_xargs"),  # vLLM allows strings, numbers and lists
    ],
)
def test_vllm_xargs_cannot_carry_transfer_params_or_objects(client, xargs, fragment):
    """vLLM copies vllm_xargs into extra_args, where its KV connectors read their params: a
    render request that would put them there is refused, and the other xargs pass."""
    body: dict[str, Any] = {"prompt": "hello", "max_tokens": 2}
    resp = client.post("/v1/completions/render", json={**body, "vllm_xargs": xargs})
    assert resp.status_code == 400, resp.text
    assert fragment in resp.text
    ok = client.post("/v1/completions/render", json={**body, "vllm_xargs": {"a": [1, "b"]}})
    assert ok.status_code == 200, ok.text
    rendered = ok.json()
    rendered = rendered[0] if isinstance(rendered, list) else rendered
    assert rendered["sampling_params"]["extra_args"] == {"a": [1, "b"]}


def test_malformed_and_oversized_bodies_are_400(client):
    bad = client.post(
        "/v1/chat/completions/render",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert bad.status_code == 400 and "malformed JSON" in bad.json()["error"]["message"]
    big = client.post("/v1/completions/render", json={"prompt": "a" * 70000})
    assert big.status_code == 400 and "exceeds the limit" in big.json()["error"]["message"]
    arr = client.post("/v1/completions/derender", json=[1, 2])
    assert arr.status_code == 400


def test_schema_errors_are_typed_as_vllms_request_validation_errors(client):
    """vLLM answers a body that is not JSON or fails the schema from its request-validation
    handler ("Bad Request", param from "body"), and its own checks with "BadRequestError"."""
    chat, completion = "/v1/chat/completions/render", "/v1/completions/render"
    as_json = {"content-type": "application/json"}
    cases: list[tuple[str, dict[str, Any], tuple[str, str]]] = [
        (chat, {"json": {"messages": "nope"}}, ("Bad Request", "body.messages")),
        (completion, {"json": {"prompt": {"a": 1}}}, ("Bad Request", "body.prompt")),
        (chat, {"json": [1, 2]}, ("Bad Request", "body")),
        (chat, {"content": b"{not json", "headers": as_json}, ("Bad Request", "body.1")),
        (chat, {"json": {"messages": [{"role": "user", "content": "x"}], "temperature": 5}},
         ("BadRequestError", "temperature")),
    ]  # fmt: skip
    for path, kwargs, expected in cases:
        resp = client.post(path, **kwargs)
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert (err["type"], err["param"]) == expected, err


def test_unknown_model_is_404(client):
    resp = client.post(
        "/v1/chat/completions/render",
        json={"model": "other", "messages": [{"role": "user", "content": "x"}]},
    )
    assert resp.status_code == 404 and resp.json()["error"]["param"] == "model"


def test_chat_derender_batch_multibyte_and_logprobs(client):
    ids = _ids(client, "Grüße, 日本語 ok")
    gen = {
        "request_id": "r1",
        "choices": [
            {
                "index": 0,
                "token_ids": [*ids, 151645],
                "finish_reason": "stop",
                "logprobs": {
                    "content": [
                        {
                            "token_id": ids[0],
                            "logprob": -0.5,
                            "top_logprobs": [{"token_id": ids[0], "logprob": -0.5}],
                        }
                    ]
                },
            }
        ],
    }
    resp = client.post(
        "/v1/chat/completions/derender", json={"generate_response": gen, "prompt_tokens": 3}
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    choice = body["choices"][0]
    assert choice["message"]["content"] == "Grüße, 日本語 ok"  # <|im_end|> skipped
    assert choice["finish_reason"] == "stop"
    assert choice["logprobs"]["content"][0]["logprob"] == -0.5
    assert body["usage"] == {
        "prompt_tokens": 3,
        "total_tokens": 3 + len(ids) + 1,
        "completion_tokens": len(ids) + 1,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def _stream_chat(client, ids: list[int], sizes: list[int], **extra) -> tuple[str, list[dict]]:
    state = None
    text = []
    chunks = []
    pos = 0
    for i, size in enumerate(sizes):
        part = ids[pos : pos + size]
        pos += size
        last = i == len(sizes) - 1
        body = {
            "stream": True,
            "generate_chunk": {
                "request_id": "r",
                "choices": [
                    {"index": 0, "token_ids": part, "finish_reason": "stop" if last else None}
                ],
            },
            "stream_state": state,
            **extra,
        }
        resp = client.post("/v1/chat/completions/derender", json=body)
        assert resp.status_code == 200, resp.text
        out = resp.json()
        state = out["stream_state"]
        assert len(state["prev_tokens"]) <= 16  # bounded window, never the whole output
        delta = out["chunk"]["choices"][0]["delta"]
        chunks.append(out["chunk"])
        text.append(delta.get("content") or "")
    return "".join(text), chunks


def test_chat_derender_stream_splits_multibyte_chars(client):
    text = "naïve 日本語 emoji 🎉 done"
    ids = _ids(client, text)
    # byte-level BPE splits 🎉 and CJK over several tokens: feed one token per chunk
    streamed, chunks = _stream_chat(client, ids, [1] * len(ids))
    assert streamed == text
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["choices"][0]["delta"]["role"] is None for c in chunks[1:])
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all("\ufffd" not in (c["choices"][0]["delta"]["content"] or "") for c in chunks)


def test_completion_derender_batch_and_stream_agree(client):
    text = "Grüße aus 東京 🎉"
    ids = _ids(client, text)
    batch = client.post(
        "/v1/completions/derender",
        json={"generate_responses": [{"request_id": "c", "choices": [{"token_ids": ids}]}]},
    ).json()
    assert batch["choices"][0]["text"] == text
    state, parts = None, []
    for i in range(0, len(ids), 3):
        resp = client.post(
            "/v1/completions/derender",
            json={
                "stream": True,
                "generate_chunk": {"choices": [{"index": 0, "token_ids": ids[i : i + 3]}]},
                "stream_state": state,
            },
        ).json()
        state = resp["stream_state"]
        parts.append(resp["chunk"]["choices"][0]["text"])
    assert "".join(parts) == text
    assert state is not None and state["logprob_text_offset"] == len(text)


def test_health_models_metrics(client):
    assert client.get("/health").status_code == 200
    models = client.get("/v1/models").json()
    assert models["data"][0]["max_model_len"] == 512
    client.post("/v1/completions/render", json={"prompt": "hello"})
    metrics = client.get("/metrics").text
    assert 'vllm_pd_render_requests_total{route="completion_render",status="200"}' in metrics
    assert "vllm_pd_render_prompt_tokens_total" in metrics


# ---- parsers ------------------------------------------------------------------------------


def _parser_chat_request() -> dict:
    return {"messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS}


def test_reasoning_and_tool_call_batch(parser_client):
    text = (
        "<think>Need the weather.</think>Let me check."
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
    )
    ids = _ids(parser_client, text)
    body = {
        "generate_response": {"choices": [{"token_ids": ids, "finish_reason": "stop"}]},
        "chat_request": _parser_chat_request(),
        "prompt_token_ids": [1, 2],
    }
    resp = parser_client.post("/v1/chat/completions/derender", json=body)
    assert resp.status_code == 200, resp.text
    msg = resp.json()["choices"][0]["message"]
    assert msg["reasoning"] == "Need the weather."
    assert msg["content"] == "Let me check."
    assert msg["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Zürich"}',
    }


@pytest.mark.parametrize("size", [1, 2, 3, 7])
def test_reasoning_and_tool_call_stream(parser_client, size):
    text = (
        "<think>Need the weather.</think>Let me check."
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
    )
    ids = _ids(parser_client, text)
    reasoning, content, finish = [], [], None
    calls: list[Any] = []
    for out in derender_chat_stream(parser_client, ids, size, _parser_chat_request(), [1, 2]):
        assert out["stream_state"]["output_token_ids"] == []  # no replay buffer
        choice = out["chunk"]["choices"][0]
        reasoning.append(choice["delta"].get("reasoning") or "")
        content.append(choice["delta"].get("content") or "")
        calls += choice["delta"].get("tool_calls") or []
        finish = choice["finish_reason"]
    # vLLM's deepseek_r1 rule: a <think> sharing its chunk with other tokens stays in reasoning
    end_id = _ids(parser_client, "</think>")[0]
    keeps_marker = size > 1 and end_id not in ids[:size]
    assert "".join(reasoning) == ("<think>" if keeps_marker else "") + "Need the weather."
    assert "".join(content) == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert calls[0]["function"]["arguments"] == '{"city": "Zürich"}'
    assert finish == "tool_calls"


@pytest.mark.parametrize(
    "forged",
    [
        {"tools": 5},
        {"tools": {"buf": 3, "in_calls": "x", "seen": []}},
        {"reasoning_ended": False, "seen_start": "x", "pending": 7, "tools": {}},
        {"tools": {"buf": "<tool_call>", "in_calls": True, "seen": 1}},
        {"tools": []},
    ],
)
def test_a_forged_parser_state_is_refused(parser_client, forged):
    """The parser state rides with the client between streaming calls: one that does not fit
    the parser's declared shape (wrong types included, which nothing coerces) is refused as
    the client's mistake, a 400 naming it (``test_parser_state.py`` forges every parser's)."""
    ids = _ids(parser_client, "hello <tool_call>")
    body = {
        "stream": True,
        "generate_chunk": {"choices": [{"token_ids": ids, "finish_reason": "stop"}]},
        "chat_request": _parser_chat_request(),
        "prompt_token_ids": [1, 2],
    }
    resp = parser_client.post(
        "/v1/chat/completions/derender", json={**body, "stream_state": {"parser_state": forged}}
    )
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "stream_state.parser_state"


def test_parser_server_requires_chat_request(parser_client):
    resp = parser_client.post(
        "/v1/chat/completions/derender",
        json={"generate_response": {"choices": [{"token_ids": [1, 2]}]}},
    )
    assert resp.status_code == 400 and "chat_request" in resp.json()["error"]["message"]


@pytest.mark.parametrize("thinking", [True, False])
def test_deepseek_v3_reasoning_follows_thinking_kwarg(tiny_qwen_think, thinking):
    settings = RenderSettings(model=str(tiny_qwen_think), reasoning_parser="deepseek_v3")
    with TestClient(create_app(settings)) as c:
        ids = _ids(c, "<think>hmm</think>Answer.")
        chat_request = {
            "messages": [{"role": "user", "content": "q"}],
            "chat_template_kwargs": {"thinking": thinking},
        }
        rendered = c.post("/v1/chat/completions/render", json=chat_request).json()
        assert rendered["reasoning_ended"] is (not thinking)
        body = {
            "generate_response": {"choices": [{"token_ids": ids}]},
            "chat_request": chat_request,
            "prompt_token_ids": rendered["token_ids"],
        }
        msg = c.post("/v1/chat/completions/derender", json=body).json()["choices"][0]["message"]
    if thinking:
        assert (msg["reasoning"], msg["content"]) == ("hmm", "Answer.")
    else:
        assert (msg["reasoning"], msg["content"]) == (None, "<think>hmm</think>Answer.")


def test_a_tool_parser_that_does_not_fit_the_tokenizer_stops_the_server(tiny_qwen):
    """Not a 500 on every tool request: the server refuses to start, naming the problem."""
    settings = RenderSettings(model=str(tiny_qwen), tool_call_parser="mistral")
    with (
        pytest.raises(ValueError, match=r"--tool-call-parser mistral does not fit"),
        TestClient(create_app(settings)),
    ):
        pass


def _stream_split(c, ids: list[int], size: int, chat_request: dict, prompt: list[int]) -> tuple:
    """``(reasoning, content)`` of ``ids`` derendered as a stream of ``size``-token chunks."""
    reasoning, content = "", ""
    for out in derender_chat_stream(c, ids, size, chat_request, prompt):
        delta = out["chunk"]["choices"][0]["delta"]
        reasoning += delta.get("reasoning") or ""
        content += delta.get("content") or ""
    return reasoning, content


def test_qwen3_reasoning_parser_serves_a_tokenizer_without_think_tokens(tiny_qwen):
    """vLLM's ``qwen3`` parser finds ``<think>`` / ``</think>`` in the text when the tokenizer
    has no such tokens: render answers 200 and derender splits at the markers, batch and
    streamed (markers cut across chunks), and ``enable_thinking: false`` turns reasoning off."""
    settings = RenderSettings(model=str(tiny_qwen), reasoning_parser="qwen3")
    with TestClient(create_app(settings)) as c:
        text = "<think>Let me think about 東京.</think>The answer is 42."
        ids = _ids(c, text)
        assert len(_ids(c, "</think>")) > 1  # the marker is plain text to this tokenizer
        for thinking, expected in (
            (None, ("Let me think about 東京.", "The answer is 42.")),
            (True, ("Let me think about 東京.", "The answer is 42.")),
            (False, (None, text)),
        ):
            chat_request: dict = {"messages": [{"role": "user", "content": "q"}]}
            if thinking is not None:
                chat_request["chat_template_kwargs"] = {"enable_thinking": thinking}
            resp = c.post("/v1/chat/completions/render", json=chat_request)
            assert resp.status_code == 200, resp.text
            rendered = resp.json()
            assert rendered["reasoning_ended"] is (thinking is False)
            # vLLM's qwen3 adjust_request keeps special tokens in the detokenized text
            assert rendered["sampling_params"]["skip_special_tokens"] is False
            prompt = rendered["token_ids"]
            body = {
                "generate_response": {"choices": [{"token_ids": ids}]},
                "chat_request": chat_request,
                "prompt_token_ids": prompt,
            }
            resp = c.post("/v1/chat/completions/derender", json=body)
            assert resp.status_code == 200, resp.text
            msg = resp.json()["choices"][0]["message"]
            assert (msg["reasoning"], msg["content"]) == expected, thinking
            for size in (1, 2, 3, 64):
                streamed = _stream_split(c, ids, size, chat_request, prompt)
                assert streamed == tuple(x or "" for x in expected), (thinking, size)


def test_a_reasoning_parser_that_needs_tokens_the_tokenizer_lacks_stops_the_server(tiny_qwen):
    """deepseek_r1 needs ``<think>`` / ``</think>`` as tokens (vLLM refuses it at startup on such
    a tokenizer): the server refuses to start with vLLM's wording, not a 500 per request."""
    settings = RenderSettings(model=str(tiny_qwen), reasoning_parser="deepseek_r1")
    with (
        pytest.raises(ValueError, match=r"--reasoning-parser deepseek_r1 cannot be used with"),
        TestClient(create_app(settings)),
    ):
        pass


def test_health_answers_while_a_render_computes(client, monkeypatch):
    """Rendering runs off the event loop: while one request is stuck computing, /health and
    another route's body reading are still served; then the stuck request finishes normally."""
    import threading

    from vllm_pd_ext.render_server.renderer import Renderer

    entered, release = threading.Event(), threading.Event()
    real = Renderer.render_completion

    def stuck(self, *args, **kwargs):
        entered.set()
        assert release.wait(60), "never released"
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Renderer, "render_completion", stuck)
    answers: dict[str, Any] = {}

    def render() -> None:
        answers["render"] = client.post("/v1/completions/render", json={"prompt": "hello"})

    worker = threading.Thread(target=render)
    worker.start()
    try:
        assert entered.wait(60), "the render never started"
        health = threading.Thread(target=lambda: answers.update(health=client.get("/health")))
        health.start()
        health.join(30)  # a blocked event loop would keep it waiting until the release
        assert "health" in answers, "/health waited for a render to finish computing"
        assert answers["health"].status_code == 200
    finally:
        release.set()
        worker.join(60)
    assert answers["render"].status_code == 200, answers["render"].text


def test_connections_beyond_the_cap_are_answered_503(tiny_qwen):
    """Clients that open connections and hold them cannot exhaust a worker: past
    ``max_connections`` a request gets 503, and once they go the worker serves again."""
    import socket
    import time

    import httpx

    from vllm_pd_ext.render_server.cli import server_limits
    from vllm_pd_ext.testing.fake_engine import ServerThread

    settings = RenderSettings(model=str(tiny_qwen), max_model_len=512, max_connections=3)
    with ServerThread(create_app(settings), **server_limits(settings)) as srv:
        held = [socket.create_connection(("127.0.0.1", srv.port), timeout=5) for _ in range(3)]
        url = f"http://127.0.0.1:{srv.port}/health"
        try:
            assert httpx.get(url, timeout=10).status_code == 503
        finally:
            for s in held:
                s.close()
        deadline = time.monotonic() + 30
        while httpx.get(url, timeout=10).status_code != 200:
            assert time.monotonic() < deadline, "never served again"
            time.sleep(0.05)
