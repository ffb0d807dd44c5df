"""The long-lived streaming derender call against the per-event calls it replaces: the proxy's
``DerenderStream`` over our real render server (real tokenizers, in-process), both ways."""

from __future__ import annotations

import asyncio
import json
import types
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response

from vllm_pd_ext import derender_stream as wire
from vllm_pd_ext.proxy.token_mode import DerenderStream, RenderTier, TokenRequest
from vllm_pd_ext.render_server import app as render_app
from vllm_pd_ext.render_server import derender as derender_module
from vllm_pd_ext.render_server.app import create_app
from vllm_pd_ext.render_server.parsers import base as parsers_base
from vllm_pd_ext.render_server.settings import RenderSettings
from vllm_pd_ext.testing.fake_engine import ServerThread
from vllm_pd_ext.util.tiny_model import add_think_tokens

#: The answer the engine "generates": multibyte text, split across byte-level tokens.
ANSWER = "Grüße, 日本語 ok 🙂 and more text: naïve café, ∑ x² — done."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
PARSED = (
    "<think>Let me think ü about it.</think>Sure, looking it up."
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
)


@pytest.fixture
def fixed(monkeypatch):
    """``created`` and tool-call ids the same in every answer (both paths take them from
    the clock and from uuid4)."""
    monkeypatch.setattr(derender_module, "time", types.SimpleNamespace(time=lambda: 1.7e9))
    monkeypatch.setattr(parsers_base, "uuid", types.SimpleNamespace(uuid4=lambda: uuid.UUID(int=7)))


@pytest.fixture(scope="module")
def plain_url(tiny_qwen) -> Iterator[str]:
    settings = RenderSettings(model=str(tiny_qwen), served_model_name="m", max_model_len=512)
    with ServerThread(create_app(settings)) as server:
        yield f"http://127.0.0.1:{server.port}"


@pytest.fixture(scope="module")
def llama_url(tiny_llama) -> Iterator[str]:
    settings = RenderSettings(model=str(tiny_llama), served_model_name="m", max_model_len=512)
    with ServerThread(create_app(settings)) as server:
        yield f"http://127.0.0.1:{server.port}"


@pytest.fixture(scope="module")
def parser_url(tiny_qwen, tmp_path_factory) -> Iterator[str]:
    model = add_think_tokens(Path(tiny_qwen), tmp_path_factory.mktemp("tiny-qwen-think"))
    settings = RenderSettings(
        model=str(model),
        served_model_name="m",
        max_model_len=512,
        reasoning_parser="deepseek_r1",
        tool_call_parser="hermes",
        enable_auto_tool_choice=True,
    )
    with ServerThread(create_app(settings)) as server:
        yield f"http://127.0.0.1:{server.port}"


def _ids(url: str, text: str) -> list[int]:
    body = {"prompt": text, "add_special_tokens": False}
    out = httpx.post(url + "/v1/completions/render", json=body, timeout=30)
    assert out.status_code == 200, out.text
    return out.json()[0]["token_ids"]


def _engine_events(ids: list[int], logprobs: bool) -> list[bytes]:
    """The engine's generate stream for ``ids``: one event per token, then usage and
    ``[DONE]``, as ``/inference/v1/generate`` writes it."""
    events: list[dict[str, Any]] = []
    for n, token in enumerate(ids):
        choice: dict = {
            "index": 0,
            "token_ids": [token],
            "finish_reason": "stop" if n == len(ids) - 1 else None,
        }
        if logprobs:
            choice["logprobs"] = {
                "content": [
                    {
                        "token_id": token,
                        "logprob": -0.25 - n / 1000,
                        "top_logprobs": [
                            {"token_id": token, "logprob": -0.25 - n / 1000},
                            {"token_id": (token + 1) % 1000, "logprob": -3.5},
                        ],
                    }
                ]
            }
        events.append({"request_id": "generate-tokens-x", "choices": [choice]})
    events.append(
        {
            "request_id": "generate-tokens-x",
            "choices": [],
            "usage": {"prompt_tokens": 9, "completion_tokens": len(ids), "total_tokens": 0},
        }
    )
    out = [b"data: " + json.dumps(e).encode() + b"\n\n" for e in events]
    return [*out, b"data: [DONE]\n\n"]


def _reads(events: list[bytes], together: bool) -> list[bytes]:
    """The events as the proxy reads them: one by one, or some arriving together (1, 2, 3,
    1, 2, 3, ... at a time; per event, the proxy merges those into one chunk)."""
    if not together:
        return events
    reads, i, size = [], 0, 1
    while i < len(events):
        reads.append(b"".join(events[i : i + size]))
        i += size
        size = 1 if size >= 3 else size + 1
    return reads


async def _derender(
    url: str,
    route: str,
    body: dict,
    events: list[bytes],
    stream_calls: bool,
    together: bool = False,
) -> tuple[bytes, DerenderStream, list[str]]:
    reasons: list[str] = []
    tier = RenderTier(
        (url,),
        timeout_s=30,
        connect_s=3,
        max_connections=4,
        per_event=reasons.append,
        stream_calls=stream_calls,
    )
    prefix = "chatcmpl-" if route == "chat" else "cmpl-"
    tokens = TokenRequest({}, list(range(100, 140)), prefix + "abc")
    stream = DerenderStream(tier, route, body, tokens, "r1")
    try:
        out = b"".join([await stream.feed(read) for read in _reads(events, together)])
    finally:
        stream.close()
        await tier.close()
    return out, stream, reasons


def _both(url: str, route: str, body: dict, events: list[bytes]) -> tuple[bytes, bytes]:
    streamed, s_stream, s_reasons = asyncio.run(_derender(url, route, body, events, True))
    per_event, p_stream, p_reasons = asyncio.run(_derender(url, route, body, events, False))
    assert (s_stream.streaming, s_reasons) == (True, [])
    assert (p_stream.streaming, p_reasons) == (False, ["stream_calls_off"])
    assert not s_stream.failed and not p_stream.failed
    return streamed, per_event


def _chunks(out: bytes) -> list[dict]:
    events = out.decode().split("\n\n")[:-1]
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[6:]) for e in events[:-1]]


@pytest.mark.parametrize("server", ["plain_url", "llama_url"])
@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize("logprobs", [False, True])
def test_streaming_call_is_byte_identical_to_per_event_calls(
    request, fixed, server, route, logprobs
):
    url = request.getfixturevalue(server)
    ids = _ids(url, ANSWER)
    if route == "chat":
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    else:
        body = {"model": "m", "prompt": "hi", "stream": True}
    events = _engine_events(ids, logprobs)
    streamed, per_event = _both(url, route, body, events)
    assert streamed == per_event
    # on the streaming call, events that arrived together are still one event each
    together, stream, _ = asyncio.run(_derender(url, route, body, events, True, together=True))
    assert stream.streaming and together == streamed
    merged, stream, _ = asyncio.run(_derender(url, route, body, events, False, together=True))
    assert not stream.streaming and merged.count(b"data: ") < streamed.count(b"data: ")
    chunks = _chunks(streamed)
    if route == "chat":
        text = "".join(c["choices"][0]["delta"]["content"] or "" for c in chunks if c["choices"])
    else:
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == ANSWER
    assert chunks[-1]["usage"]["completion_tokens"] == len(ids)
    assert all(c["id"] == ("chatcmpl-abc" if route == "chat" else "cmpl-abc") for c in chunks)
    if logprobs:
        assert any(c["choices"] and c["choices"][0]["logprobs"] for c in chunks)


def test_streaming_call_off_the_event_loop_is_byte_identical(fixed, monkeypatch, plain_url):
    """Chunks the render server hands to its CPU thread (not derendered inline) answer the
    same bytes."""
    monkeypatch.setattr(render_app, "INLINE_BYTES", 0)
    ids = _ids(plain_url, ANSWER)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    streamed, per_event = _both(plain_url, "chat", body, _engine_events(ids, True))
    assert streamed == per_event


def test_streaming_call_with_reasoning_and_tool_parsers_is_byte_identical(fixed, parser_url):
    ids = _ids(parser_url, PARSED)
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "weather in Zürich?"}],
        "tools": TOOLS,
        "stream": True,
    }
    streamed, per_event = _both(parser_url, "chat", body, _engine_events(ids, False))
    assert streamed == per_event
    chunks = [c for c in _chunks(streamed) if c["choices"]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning") or "" for d in deltas) == "Let me think ü about it."
    assert "".join(d.get("content") or "" for d in deltas) == "Sure, looking it up."
    calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
    assert calls[0]["function"]["name"] == "get_weather"
    args = "".join(tc["function"].get("arguments") or "" for tc in calls)
    assert json.loads(args) == {"city": "Zürich"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def _open(url: str, route: str, body: bytes) -> httpx.Response:
    return httpx.post(
        url + wire.PATHS[route],
        content=body,
        headers={"Content-Type": wire.CONTENT_TYPE},
        timeout=30,
    )


def test_bad_context_is_an_openai_error_before_the_stream(plain_url):
    resp = _open(plain_url, "chat", b"not json\n")
    assert resp.status_code == 400
    assert resp.json()["error"]["type"] == "Bad Request"
    resp = _open(plain_url, "chat", wire.line({"model": "other"}))
    assert resp.status_code == 404 and resp.json()["error"]["param"] == "model"
    carried = wire.line({"model": "m", "stream_state": {}})
    resp = _open(plain_url, "completions", carried)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "stream_state"
    resp = _open(plain_url, "chat", b"")
    assert resp.status_code == 400 and "line 1" in resp.json()["error"]["message"]


def test_bad_chunk_ends_the_stream_with_one_error_event(plain_url):
    good = {"request_id": "x", "choices": [{"index": 0, "token_ids": [100]}]}
    body = (
        wire.line({"model": "m"})
        + wire.line(good)
        + wire.line({"request_id": "x", "choices": [{"index": 0, "token_ids": ["no"]}]})
        + wire.line(good)
    )
    resp = _open(plain_url, "completions", body)
    assert resp.status_code == 200
    events = resp.text.split("\n\n")[:-1]
    assert len(events) == 2  # the good chunk, then the error; the last chunk is not read
    assert json.loads(events[0][6:])["object"] == "text_completion"
    error = json.loads(events[1][6:])["error"]
    assert error["code"] == 400 and error["param"].startswith("generate_chunk")


def test_stream_longer_than_the_model_is_refused(tiny_qwen):
    settings = RenderSettings(model=str(tiny_qwen), served_model_name="m", max_model_len=8)
    chunk = {"request_id": "x", "choices": [{"index": 0, "token_ids": [100, 101, 102]}]}
    with ServerThread(create_app(settings)) as server:
        url = f"http://127.0.0.1:{server.port}"
        resp = _open(url, "completions", wire.line({"model": "m"}) + wire.line(chunk) * 3)
    events = resp.text.split("\n\n")[:-1]
    assert len(events) == 3  # 6 tokens fit, the 9th does not
    assert "max_model_len" in json.loads(events[2][6:])["error"]["message"]


def test_render_tier_without_the_route_goes_per_event_counted_once(fixed, plain_url):
    """vLLM's render server has no streaming route: 404. The proxy then derenders per event,
    tells ``per_event`` why, and does not ask that server again for a while."""
    probes = []
    vllm_like = FastAPI()

    @vllm_like.post("/v1/chat/completions/derender")
    async def derender(request: Request) -> Response:  # vLLM's route, served by ours
        async with httpx.AsyncClient() as client:
            answer = await client.post(
                plain_url + "/v1/chat/completions/derender", content=await request.body()
            )
        return Response(answer.content, status_code=answer.status_code)

    @vllm_like.middleware("http")
    async def seen(request: Request, call_next):
        probes.append(request.url.path)
        return await call_next(request)

    ids = _ids(plain_url, ANSWER)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    events = _engine_events(ids, False)

    async def twice() -> list[tuple[bytes, DerenderStream]]:
        reasons: list[str] = []
        with ServerThread(vllm_like) as server:
            tier = RenderTier(
                (f"http://127.0.0.1:{server.port}",),
                timeout_s=30,
                connect_s=3,
                max_connections=4,
                per_event=reasons.append,
            )
            tokens = TokenRequest({}, list(range(100, 140)), "chatcmpl-abc")
            outs = []
            for _ in range(2):
                stream = DerenderStream(tier, "chat", body, tokens, "r1")
                out = b"".join([await stream.feed(read) for read in _reads(events, True)])
                stream.close()
                outs.append((out, stream))
            await tier.close()
        assert reasons == ["no_stream_route", "no_stream_route"]
        return outs

    (first, s1), (second, s2) = asyncio.run(twice())
    assert s1.streaming is False and s2.streaming is False
    assert first == second
    assert probes.count(wire.PATHS["chat"]) == 1  # asked once, remembered
    direct, _, _ = asyncio.run(_derender(plain_url, "chat", body, events, False, together=True))
    assert first == direct


def test_render_server_gone_mid_stream_is_one_error_event(tiny_qwen, fixed):
    settings = RenderSettings(model=str(tiny_qwen), served_model_name="m", max_model_len=512)
    body = {"model": "m", "prompt": "hi", "stream": True}
    chunk = {"request_id": "x", "choices": [{"index": 0, "token_ids": [100]}]}
    event = b"data: " + json.dumps(chunk).encode() + b"\n\n"

    async def run() -> tuple[bytes, bytes, DerenderStream]:
        server = ServerThread(create_app(settings))
        with server:
            tier = RenderTier(
                (f"http://127.0.0.1:{server.port}",), timeout_s=5, connect_s=3, max_connections=4
            )
            stream = DerenderStream(tier, "completions", body, TokenRequest({}, [1, 2], "c"), "r")
            first = await stream.feed(event)
            server.server.force_exit = True
        second = await stream.feed(event)
        stream.close()
        await tier.close()
        return first, second, stream

    first, second, stream = asyncio.run(run())
    assert json.loads(first[6:-2])["object"] == "text_completion"
    error = json.loads(second[6:-2])["error"]
    assert error["code"] == 502 and "streaming derender" in error["message"]
    assert stream.failed
