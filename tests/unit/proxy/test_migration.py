"""Request migration against fake engines: a decode instance that dies part-way, and the
client's answer finished on another instance as if nothing happened (migration.py)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.unit.proxy.helpers import LONG, SHORT, metric, proxy, wait_until
from vllm_pd_ext.proxy.migration import Migration
from vllm_pd_ext.proxy.request import RequestContext
from vllm_pd_ext.testing.fake_engine import Behavior

ROUTES = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def _body(route: str, prompt: str, max_tokens: int, **extra) -> dict:
    body: dict = {"model": "m", "max_tokens": max_tokens, "stream": True, **extra}
    if route == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _stream(base: str, route: str, body: dict) -> list[Any]:
    """The stream's events, parsed (``[DONE]`` as the string)."""
    with httpx.stream("POST", f"{base}{ROUTES[route]}", timeout=60, json=body) as r:
        assert r.status_code == 200
        return [
            json.loads(line[6:]) if line.startswith("data: {") else line[6:]
            for line in r.iter_lines()
            if line.startswith("data: ")
        ]


def _text(events: list, route: str) -> str:
    key = "delta" if route == "chat" else None
    out = []
    for e in events:
        for c in e.get("choices", []) if isinstance(e, dict) else []:
            out.append((c.get(key) or {}).get("content") or "" if key else c.get("text", ""))
    return "".join(out)


@pytest.fixture(autouse=True)
def stamps(engines):
    """Each engine's streams with an id and a created time of its own."""
    for stamp, engine in enumerate(engines.values(), 1):
        engine.stamp = stamp


def _die_once(engines, after: int) -> None:
    """The next answer from either decode instance breaks after ``after`` tokens (one
    ``Behavior`` for both: the first to die clears it)."""
    engines["d1"].behavior = engines["d2"].behavior = Behavior(
        die_after_tokens=after, die_once=True
    )


@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["colocated", "split"])
def test_a_stream_broken_mid_way_is_continued_on_another_decode_as_one_answer(
    engines, route, prompt
):
    body = _body(route, prompt, 8, stream_options={"include_usage": True})
    with proxy(engines, max_migrations=1) as (base, _):
        whole = _stream(base, route, body)
        _die_once(engines, 3)
        for d in ("d1", "d2"):
            engines[d].requests.clear()
        moved = _stream(base, route, body)
        assert metric(base, "vllm_pd_migrations_total", outcome="continued") == 1
        wait_until(lambda: metric(base, "vllm_pd_requests_total", outcome="ok") == 2)
    assert moved[-1] == "[DONE]" and not any("error" in e for e in moved if isinstance(e, dict))
    assert _text(moved, route) == _text(whole, route)
    chunks = [e for e in moved if isinstance(e, dict)]
    # one answer: one id, created and model, one finish, the usage of the whole
    assert len({(c["id"], c["created"], c["model"]) for c in chunks}) == 1
    assert all(c["object"] == chunks[0]["object"] for c in chunks)
    finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert finishes == ["length"]
    assert chunks[-1]["usage"]["completion_tokens"] == 8
    assert chunks[-1]["usage"]["prompt_tokens"] == whole[-2]["usage"]["prompt_tokens"]
    # the client did not ask for token ids: it sees none
    assert all(ch.get("token_ids") is None for c in chunks for ch in c["choices"])
    assert all(c.get("prompt_token_ids") is None for c in chunks)
    # the continuation: a completion of the prompt's ids and the three generated, colocated
    legs = [r["body"] for d in ("d1", "d2") for r in engines[d].requests if r["body"]["stream"]]
    (cont,) = [leg for leg in legs if isinstance(leg.get("prompt"), list)]
    (first,) = [leg for leg in legs if leg is not cont]
    assert "kv_transfer_params" not in cont and "messages" not in cont
    assert (
        cont["max_tokens"] == 5 and len(cont["prompt"]) == whole[-2]["usage"]["prompt_tokens"] + 3
    )
    assert cont["return_token_ids"] is True and first["return_token_ids"] is True


def test_token_ids_asked_for_by_the_client_come_through_a_migration(engines):
    body = _body("completions", SHORT, 6, return_token_ids=True)
    with proxy(engines, max_migrations=1) as (base, _):
        whole = _stream(base, "completions", body)
        _die_once(engines, 2)
        moved = _stream(base, "completions", body)
    ids = [t for e in moved if isinstance(e, dict) for c in e["choices"] for t in c["token_ids"]]
    assert ids == [
        t for e in whole if isinstance(e, dict) for c in e["choices"] for t in c["token_ids"]
    ]
    assert len(ids) == 6
    prompts = [
        c.get("prompt_token_ids") for e in moved if isinstance(e, dict) for c in e["choices"]
    ]
    assert prompts[0] and not any(prompts[1:])  # the prompt's ids once, from the first leg


def test_a_stream_that_breaks_again_past_the_limit_ends_with_one_error_event(engines):
    for d in ("d1", "d2"):
        engines[d].behavior.die_after_tokens = 2
    with proxy(engines, max_migrations=1) as (base, _):
        events = _stream(base, "completions", _body("completions", SHORT, 8))
        assert metric(base, "vllm_pd_migrations_total", outcome="continued") == 1
        assert metric(base, "vllm_pd_migrations_total", outcome="limit") == 1
        failed = {"outcome": "decode_failed_mid_stream"}
        wait_until(lambda: metric(base, "vllm_pd_requests_total", **failed) == 1)
        wait_until(lambda: metric(base, "vllm_pd_in_flight") == 0)
    # two tokens from each, then the error event, no [DONE]
    assert all(e["choices"][0]["text"] for e in events[:4])
    assert len(events) == 5 and events[-1]["error"]["code"] == 502


def test_with_no_decode_left_a_stream_goes_on_where_it_can_be_served(engines):
    engines["d1"].behavior.die_after_tokens = 3
    engines["d1"].behavior.die_once = True
    engines["d2"].behavior.status = 500  # the other decode refuses: a prefill instance serves
    with proxy(engines, max_migrations=1) as (base, _):
        events = _stream(base, "completions", _body("completions", SHORT, 6))
        assert metric(base, "vllm_pd_migrations_total", outcome="continued") == 1
    assert events[-1] == "[DONE]"
    assert len([t for e in events if isinstance(e, dict) for t in e["choices"]]) >= 6
    served = [p for p in ("p1", "p2") if engines[p].requests]
    assert served and "prompt" in engines[served[0]].requests[-1]["body"]


def test_a_stream_whose_engine_breaks_after_its_last_token_is_ended_by_the_proxy(engines):
    _die_once(engines, 4)
    body = _body("completions", SHORT, 4, stream_options={"include_usage": True})
    with proxy(engines, max_migrations=1) as (base, _):
        events = _stream(base, "completions", body)
        assert metric(base, "vllm_pd_migrations_total", outcome="finished") == 1
        sent = sum(len(engines[d].requests) for d in ("d1", "d2"))
    assert sent == 1  # nothing left to generate: no other engine asked
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 4


def test_a_request_that_cannot_be_continued_exactly_keeps_the_error_event(engines):
    _die_once(engines, 2)
    with proxy(engines, max_migrations=1) as (base, _):
        events = _stream(base, "completions", _body("completions", SHORT, 6, stop=["zz"]))
        assert metric(base, "vllm_pd_migrations_total", outcome="continued") == 0
    assert events[-1]["error"]["code"] == 502
    # nor is it asked for token ids it does not need
    assert all(
        "return_token_ids" not in r["body"] for d in ("d1", "d2") for r in engines[d].requests
    )


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_a_whole_answer_cut_after_its_head_is_asked_again_elsewhere(engines, route):
    _die_once(engines, 0)
    body = {**_body(route, SHORT, 4), "stream": False}
    with proxy(engines, max_migrations=1) as (base, _):
        resp = httpx.post(f"{base}{ROUTES[route]}", json=body, timeout=60)
        assert metric(base, "vllm_pd_migrations_total", outcome="rerun") == 1
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 4


def test_a_whole_answer_cut_with_migration_off_is_a_502(engines):
    _die_once(engines, 0)
    body = {**_body("completions", SHORT, 4), "stream": False}
    with proxy(engines, max_migrations=0) as (base, _):
        resp = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 502 and resp.json()["error"]["code"] == "decode_failed"


# -- the record and the rewriting, on vLLM's own bytes -------------------------------------


def _ctx(route: str, **body) -> RequestContext:
    return RequestContext(
        route=route,  # type: ignore[arg-type]
        body=body,
        request_id="pdx-1",
        stream=True,
        est_prompt_tokens=3,
        affinity_key="",
        splittable=True,
    )


def test_the_ids_the_proxy_asked_for_read_as_null_as_vllm_writes_them_unasked():
    m = Migration(_ctx("completions", prompt="abc", max_tokens=5, min_tokens=4), False)
    asked = (
        b'data: {"id":"cmpl-1","object":"text_completion","created":7,"model":"m","choices":'
        b'[{"index":0,"text":" a","logprobs":null,"finish_reason":null,"stop_reason":null,'
        b'"prompt_token_ids":[1,2,3],"token_ids":[9,8]}]}\n\n'
    )
    unasked = asked.replace(b"[1,2,3]", b"null").replace(b"[9,8]", b"null")
    assert m.feed(asked) == unasked
    assert m.prompt_ids == [1, 2, 3] and m.generated == [9, 8]
    path, body = m.continuation(_ctx("completions", prompt="abc", max_tokens=5, min_tokens=4))
    assert path == "/v1/completions"
    assert body["prompt"] == [1, 2, 3, 9, 8] and body["max_tokens"] == 3
    assert body["min_tokens"] == 2 and body["return_token_ids"] is True


def test_a_chat_goes_on_as_a_completion_of_its_rendered_prompt_and_reads_as_the_chat():
    ctx = _ctx(
        "chat",
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=4,
        temperature=0,
        tool_choice="none",
        stream_options={"include_usage": True},
    )
    m = Migration(ctx, False)
    role = (
        b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"m",'
        b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
        b'"finish_reason":null}],"prompt_token_ids":[5,6]}\n\n'
    )
    empty = (
        b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"m",'
        b'"choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":null,'
        b'"token_ids":[11]}]}\n\n'
    )
    assert m.feed(role) == role.replace(b"[5,6]", b"null")
    assert m.feed(empty) == b""  # sent only for its ids
    path, body = m.continuation(ctx)
    assert path == "/v1/completions" and "messages" not in body and "tool_choice" not in body
    assert body["prompt"] == [5, 6, 11] and body["max_tokens"] == 3 and body["temperature"] == 0
    m.moves, m.before = 1, 1
    cont = (
        b'data: {"id":"cmpl-2","object":"text_completion","created":9,"model":"m","choices":'
        b'[{"index":0,"text":" b","logprobs":null,"finish_reason":"length","stop_reason":null,'
        b'"prompt_token_ids":[5,6,11],"token_ids":[12]}]}\n\n'
        b'data: {"id":"cmpl-2","object":"text_completion","created":9,"model":"m","choices":[],'
        b'"usage":{"prompt_tokens":3,"total_tokens":4,"completion_tokens":1}}\n\n'
    )
    token, usage = (json.loads(e[6:]) for e in m.feed(cont).split(b"\n\n")[:2])
    assert token["id"] == "chatcmpl-1" and token["created"] == 7
    assert token["object"] == "chat.completion.chunk"
    assert token["choices"][0]["delta"] == {"content": " b"}
    assert token["choices"][0]["finish_reason"] == "length"
    assert token["choices"][0]["token_ids"] is None
    assert usage["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}


_COMPLETION_EVENT = (
    b'data: {"id":"cmpl-1","object":"text_completion","created":7,"model":"m","choices":'
    b'[{"index":0,"text":" a","logprobs":null,"finish_reason":null,"stop_reason":null,'
    b'"prompt_token_ids":[1,2,3],"token_ids":[9,8]}]}\n\n'
)

_CHAT_EVENTS = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"m",'
    b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
    b'"finish_reason":null}],"prompt_token_ids":[1,2,3]}\n\n'
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"m",'
    b'"choices":[{"index":0,"delta":{"content":" a"},"logprobs":null,"finish_reason":null,'
    b'"token_ids":[9,8]}]}\n\n'
)


def test_a_completion_without_max_tokens_goes_on_to_vllms_default_of_16_in_all():
    # vLLM's completions default max_tokens to 16: the continuation may add only what is left
    ctx = _ctx("completions", prompt="abc")
    m = Migration(ctx, False)
    m.feed(_COMPLETION_EVENT)
    assert m.left() == 14
    _, body = m.continuation(ctx)
    assert body["max_tokens"] == 14


@pytest.mark.parametrize(
    ("route", "limits"),
    [
        ("chat", {}),  # a chat's default: as many as the context leaves
        ("chat", {"max_tokens": None, "max_completion_tokens": None}),
        ("completions", {"max_tokens": None}),  # null asked: likewise
    ],
)
def test_an_answer_without_a_limit_goes_on_without_one(route, limits):
    # the continuation is a completion, whose absent max_tokens would mean 16: null it is
    if route == "chat":
        ctx = _ctx(route, messages=[{"role": "user", "content": "hi"}], **limits)
        event = _CHAT_EVENTS
    else:
        ctx = _ctx(route, prompt="abc", **limits)
        event = _COMPLETION_EVENT
    m = Migration(ctx, False)
    m.feed(event)
    assert m.left() is None
    _, body = m.continuation(ctx)
    assert "max_tokens" in body and body["max_tokens"] is None
    assert body["prompt"] == [1, 2, 3, 9, 8]


def _vllm_stream(ids: bytes | None) -> list[bytes]:
    """A completion's events as vLLM writes them (compact JSON), with ``ids`` (``b"[%d]"``
    for the ids asked for, ``b"null"`` for none) or without the fields."""
    out = []
    for i, finish in enumerate((b"null", b"null", b'"length"')):
        extra = b""
        if ids is not None:
            prompt = b"[1,2,3]" if ids != b"null" else b"null"
            own = ids % (9 - i) if ids != b"null" else b"null"
            extra = (b',"prompt_token_ids":%b' % prompt if i == 0 else b"") + (
                b',"token_ids":%b' % own
            )
        out.append(
            b'data: {"id":"cmpl-1","object":"text_completion","created":7,"model":"m","choices":'
            b'[{"index":0,"text":" t%d","logprobs":null,"finish_reason":%b,"stop_reason":null'
            b"%b}]}\n\n" % (i, finish, extra)
        )
    out.append(
        b'data: {"id":"cmpl-1","object":"text_completion","created":7,"model":"m","choices":[],'
        b'"usage":{"prompt_tokens":3,"total_tokens":6,"completion_tokens":3}}\n\n'
    )
    return out


def test_a_stream_read_event_by_event_or_in_one_piece_gives_the_same_record_and_bytes():
    ctx = _ctx("completions", prompt="abc", max_tokens=5, stream_options={"include_usage": True})
    asked = _vllm_stream(b"[%d]")
    one, whole = Migration(ctx, False), Migration(ctx, False)
    shown = b"".join(one.feed(e) for e in asked)
    assert shown == whole.feed(b"".join(asked))
    # the client sees what vLLM writes when not asked for ids: null in their place
    assert shown == b"".join(_vllm_stream(b"null"))
    for m in (one, whole):
        assert m.generated == [9, 8, 7] and m.prompt_ids == [1, 2, 3]
        assert m.finish == "sent" and m.usage_sent and m.why_not is None
        assert m.head == {"id": "cmpl-1", "created": 7, "model": "m"}


def test_an_engine_that_sends_no_ids_leaves_a_stream_that_cannot_be_continued():
    m = Migration(_ctx("completions", prompt="abc", max_tokens=5), False)
    events = _vllm_stream(None)
    assert b"".join(m.feed(e) for e in events) == b"".join(events)
    assert m.why_not == "text without token ids" and m.generated == [] and m.finish == "sent"


@pytest.mark.parametrize("client_ids", [False, True])
def test_a_chat_read_event_by_event_or_in_one_piece_gives_the_same_record_and_bytes(client_ids):
    # one event at a time takes ``feed``'s rule for compact events; in one piece, each event
    # is read on its own: the same bytes for the client and the same record either way
    ctx = _ctx(
        "chat",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        stream_options={"include_usage": True},
    )
    head = b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"m",'
    events = [
        _CHAT_EVENTS.partition(b"\n\n")[0] + b"\n\n",  # the role, with the prompt's ids
        head + b'"choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":null,'
        b'"token_ids":[7]}]}\n\n',  # sent only for its ids
        _CHAT_EVENTS.partition(b"\n\n")[2],  # " a", ids 9 and 8
        head.replace(b'":', b'": ') + b'"choices": [{"index": 0, "delta": {"content": " b"}, '
        b'"finish_reason": null, "token_ids": [6]}]}\n\n',  # JSON with spaces
        head + b'"choices":[{"index":0,"delta":{"content":""},"logprobs":null,'
        b'"finish_reason":"length","token_ids":[]}]}\n\n',
        head + b'"choices":[],"usage":{"prompt_tokens":3,"total_tokens":7,"completion_tokens":4}}'
        b"\n\n",
        b"data: [DONE]\n\n",
    ]
    one, whole = Migration(ctx, client_ids), Migration(ctx, client_ids)
    shown = b"".join(one.feed(e) for e in events)
    assert shown == whole.feed(b"".join(events))
    assert (b"[9,8]" in shown) is client_ids and (b'"delta":{}' in shown) is client_ids
    for m in (one, whole):
        assert m.generated == [7, 9, 8, 6] and m.prompt_ids == [1, 2, 3]
        assert m.finish == "sent" and m.usage_sent and m.done and m.why_not is None
        assert m.head == {"id": "chatcmpl-1", "created": 7, "model": "m"}
