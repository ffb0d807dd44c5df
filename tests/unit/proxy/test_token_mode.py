"""Token mode: the proxy renders through a real render server (ours, in-process) and sends
token ids to fake engines' ``/inference/v1/generate``; answers come back through derender."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.unit.proxy.helpers import LONG, SHORT, metric, proxy, sent, wait_until
from vllm_pd_ext.proxy.token_mode import DerenderStream, RenderTier, TokenRequest, coalesce
from vllm_pd_ext.render_server.app import create_app as create_render_app
from vllm_pd_ext.render_server.settings import RenderSettings
from vllm_pd_ext.testing.fake_engine import Behavior, ServerThread, gen_ids
from vllm_pd_ext.transfer_params import NixlPrefill
from vllm_pd_ext.util.vllm_process import free_port

MODEL = "tiny"


@pytest.fixture(scope="module")
def render_url(tiny_llama) -> Iterator[str]:
    settings = RenderSettings(model=str(tiny_llama), served_model_name=MODEL)
    with ServerThread(create_render_app(settings)) as server:
        yield f"http://127.0.0.1:{server.port}"


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(tiny_llama) / "tokenizer.json"))


def _render(render_url: str, route: str, body: dict) -> list[int]:
    path = "/v1/chat/completions/render" if route == "chat" else "/v1/completions/render"
    out = httpx.post(render_url + path, json=body, timeout=30).json()
    return (out[0] if isinstance(out, list) else out)["token_ids"]


def _expected(prompt_ids: list[int], n: int) -> list[int]:
    return gen_ids(prompt_ids, n)


def _events(text: str) -> list[dict]:
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    return [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]


def test_completion_split_runs_both_legs_on_generate(engines, render_url, tokenizer):
    body = {"model": MODEL, "prompt": LONG, "max_tokens": 6, "return_token_ids": True}
    prompt_ids = _render(render_url, "completions", body)
    with proxy(engines, render=[render_url]) as (base, _):
        resp = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    expected = _expected(prompt_ids, 6)
    assert data["object"] == "text_completion"
    assert data["id"].startswith("cmpl-")
    assert data["choices"][0]["token_ids"] == expected
    assert data["choices"][0]["text"] == tokenizer.decode(expected)
    assert data["usage"]["prompt_tokens"] == len(prompt_ids)
    assert data["usage"]["completion_tokens"] == 6
    assert "kv_transfer_params" not in data or data["kv_transfer_params"] is None

    (pre,) = [r for n in ("p1", "p2") for r in sent(engines[n])]
    assert pre["token_ids"] == prompt_ids
    assert pre["sampling_params"]["max_tokens"] == 1
    assert pre["stream"] is False
    assert pre["kv_transfer_params"] == NixlPrefill().params()
    # the KV's one token, then the answer from the decode instance's cache
    dec, rest = [r for n in ("d1", "d2") for r in sent(engines[n])]
    assert dec["sampling_params"]["max_tokens"] == 1
    assert rest["sampling_params"]["max_tokens"] == 6 and not rest.get("kv_transfer_params")
    assert dec["kv_transfer_params"]["do_remote_prefill"] is True
    assert dec["kv_transfer_params"]["remote_request_id"].startswith("generate-tokens-")
    assert sum(e.pulls for e in engines.values()) == 1  # the decode side pulled P's blocks


def test_chat_stream_equals_chat_batch(engines, render_url, tokenizer):
    messages = [{"role": "user", "content": LONG}]
    batch = {"model": MODEL, "messages": messages, "max_tokens": 9}
    stream = {**batch, "stream": True, "stream_options": {"include_usage": True}}
    prompt_ids = _render(render_url, "chat", batch)
    with proxy(engines, render=[render_url]) as (base, _):
        whole = httpx.post(f"{base}/v1/chat/completions", json=batch, timeout=30).json()
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=stream, timeout=30) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events = _events(r.read().decode())
    expected_text = tokenizer.decode(_expected(prompt_ids, 9))
    assert whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"]["content"] == expected_text
    assert whole["usage"]["prompt_tokens"] == len(prompt_ids)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert len({e["id"] for e in events}) == 1 and events[0]["id"].startswith("chatcmpl-")
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert text == expected_text
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
    assert events[-1]["choices"] == []
    assert events[-1]["usage"]["completion_tokens"] == 9
    assert events[-1]["usage"]["prompt_tokens"] == len(prompt_ids)
    # Both answers were split: two prefill legs, two decode legs.
    assert len([r for n in ("p1", "p2") for r in sent(engines[n])]) == 2


def test_short_prompt_is_one_generate_on_decode(engines, render_url, tokenizer):
    body = {"model": MODEL, "prompt": SHORT, "max_tokens": 4}
    prompt_ids = _render(render_url, "completions", body)
    with proxy(engines, render=[render_url]) as (base, _):
        data = httpx.post(f"{base}/v1/completions", json=body, timeout=30).json()
    assert data["choices"][0]["text"] == tokenizer.decode(_expected(prompt_ids, 4))
    assert not sent(engines["p1"]) and not sent(engines["p2"])
    (dec,) = [r for n in ("d1", "d2") for r in sent(engines[n])]
    assert dec["kv_transfer_params"] == {} and dec["token_ids"] == prompt_ids


def test_a_client_cannot_steer_the_decode_connector_through_vllm_xargs(engines, render_url):
    """vLLM copies vllm_xargs into extra_args, where its connectors read kv_transfer_params:
    the proxy removes the steering fields before render, keeps the client's other xargs, and
    sends its own explicit (empty) kv_transfer_params, which vLLM's generate route puts over
    anything left in extra_args."""
    evil = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 9}
    body = {
        "model": MODEL,
        "prompt": SHORT,
        "max_tokens": 2,
        "vllm_xargs": {"kv_transfer_params": evil, "ec_transfer_params": evil, "mine": 7},
        "ec_transfer_params": evil,
    }
    with proxy(engines, render=[render_url]) as (base, _):
        resp = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    (dec,) = [r for n in ("d1", "d2") for r in sent(engines[n])]
    assert dec["kv_transfer_params"] == {} and dec.get("ec_transfer_params") is None
    assert dec["sampling_params"]["extra_args"] == {"mine": 7}


def test_a_render_tier_that_passes_steering_on_is_overruled(engines):
    """A render tier (vLLM's own) that copies a client's kv_transfer_params into extra_args:
    the generate body the proxy sends carries none of it."""
    from fastapi import FastAPI

    evil = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 9}
    render = FastAPI()

    @render.post("/v1/completions/render")
    async def rendered() -> dict:
        sampling = {"max_tokens": 2, "extra_args": {"kv_transfer_params": evil, "mine": 1}}
        return {
            "request_id": "cmpl-x",
            "token_ids": [1, 2, 3],
            "sampling_params": sampling,
            "kv_transfer_params": evil,
            "ec_transfer_params": evil,
        }

    with (
        ServerThread(render) as server,
        proxy(engines, render=[f"http://127.0.0.1:{server.port}"]) as (base, _),
    ):
        httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": SHORT}, timeout=30)
    (dec,) = [r for n in ("d1", "d2") for r in sent(engines[n])]
    assert dec["kv_transfer_params"] == {} and dec["ec_transfer_params"] is None
    assert dec["sampling_params"]["extra_args"] == {"mine": 1}


def test_a_completion_with_a_list_of_prompts_is_answered_like_vllm(engines, render_url, tokenizer):
    """One generate request per prompt on one decode instance; one response whose choices
    are numbered by prompt, whole or streamed (one usage chunk with the totals, one
    [DONE])."""
    prompts = [SHORT, "another prompt here", LONG]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 5}
    ids = [_render(render_url, "completions", {**body, "prompt": p}) for p in prompts]
    expected = [tokenizer.decode(_expected(i, 5)) for i in ids]
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with proxy(engines, render=[render_url]) as (base, _):
        whole = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
        with httpx.stream("POST", f"{base}/v1/completions", json=stream, timeout=30) as r:
            assert r.status_code == 200
            text = r.read().decode()
        assert metric(base, "vllm_pd_decisions_total", reason="not_splittable") == 2
    assert whole.status_code == 200, whole.text
    data = whole.json()
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    assert [c["text"] for c in data["choices"]] == expected
    assert data["usage"]["prompt_tokens"] == sum(len(i) for i in ids)
    assert data["usage"]["completion_tokens"] == 15
    assert not sent(engines["p1"]) and not sent(engines["p2"])
    legs = [r for n in ("d1", "d2") for r in engines[n].requests]
    assert sorted(tuple(r["body"]["token_ids"]) for r in legs) == sorted(tuple(i) for i in ids * 2)
    assert len({r["headers"]["x-request-id"] for r in legs}) == 6  # one engine id each

    assert text.count("data: [DONE]") == 1
    events = _events(text)
    assert len({e["id"] for e in events}) == 1 and events[0]["id"].startswith("cmpl-")
    by_index: dict[int, str] = {}
    for e in events:
        for c in e["choices"]:
            by_index[c["index"]] = by_index.get(c["index"], "") + c["text"]
    assert [by_index[i] for i in range(3)] == expected
    (usage,) = [e["usage"] for e in events if e.get("usage")]
    assert usage["prompt_tokens"] == sum(len(i) for i in ids)
    assert usage["completion_tokens"] == 15
    assert events[-1]["choices"] == [] and events[-1]["usage"] == usage


def test_render_400_passes_through(engines, render_url):
    body = {"model": MODEL, "prompt": LONG, "suffix": "x"}
    with proxy(engines, render=[render_url]) as (base, _):
        resp = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
        wrong = httpx.post(
            f"{base}/v1/chat/completions",
            json={"model": "other", "messages": [{"role": "user", "content": "x"}]},
            timeout=30,
        )
    assert resp.status_code == 400
    assert "suffix" in resp.json()["error"]["message"]
    assert resp.json()["error"]["type"] == "BadRequestError"
    assert wrong.status_code == 404 and "other" in wrong.json()["error"]["message"]
    assert not any(sent(e) for e in engines.values())


def test_a_render_server_with_an_api_key(engines, tiny_llama):
    """A render server started with an API key answers only the proxy that has it; a proxy
    without it gets 502 render_failed (its configuration), never the render server's 401."""
    settings = RenderSettings(model=str(tiny_llama), served_model_name=MODEL, api_key="rk")
    body = {"model": MODEL, "prompt": SHORT, "max_tokens": 2}
    with ServerThread(create_render_app(settings)) as server:
        url = f"http://127.0.0.1:{server.port}"
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        for headers in ({}, {"Authorization": "Bearer nope"}):
            direct = httpx.post(f"{url}/v1/completions/render", json=body, headers=headers)
            assert direct.status_code == 401 and direct.json()["error"]["code"] == 401
        with proxy(engines, render=[url], render_api_key="rk") as (base, _):
            ok = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
            assert ok.status_code == 200, ok.text
        with proxy(engines, render=[url]) as (base, _):
            refused = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
            assert refused.status_code == 502 and refused.json()["error"]["code"] == "render_failed"


def test_render_tier_unreachable_is_502(engines):
    dead = f"http://127.0.0.1:{free_port()}"
    with proxy(engines, render=[dead]) as (base, _):
        resp = httpx.post(f"{base}/v1/completions", json={"prompt": LONG}, timeout=30)
    assert resp.status_code == 502
    assert resp.json()["error"]["code"] == "render_failed"
    assert not any(sent(e) for e in engines.values())


def test_a_client_reusing_anothers_request_id_cannot_abort_it(engines, render_url):
    """Two clients send the same X-Request-Id; one disconnects. The abort the proxy sends
    names only the leaver's engine request (the proxy's own id), and the other client's
    answer arrives whole."""
    for name in ("d1", "d2"):
        engines[name].behavior.token_delay_s = 0.05
    body = {
        "model": MODEL,
        "prompt": SHORT,
        "max_tokens": 30,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    same = {"X-Request-Id": "shared-id"}
    with proxy(engines, render=[render_url], decode_policy="round-robin") as (base, _):
        with httpx.stream(
            "POST", f"{base}/v1/completions", json=body, headers=same, timeout=60
        ) as victim:
            with httpx.stream(
                "POST", f"{base}/v1/completions", json=body, headers=same, timeout=60
            ) as attacker:
                for line in attacker.iter_lines():
                    if line.startswith("data: {"):
                        break
            wait_until(lambda: any(e.aborted for e in engines.values()))
            events = [line for line in victim.iter_lines() if line.startswith("data: ")]
        assert victim.headers["x-request-id"] == "shared-id"
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["usage"]["completion_tokens"] == 30
    engine_ids = [
        r["headers"]["x-request-id"]
        for e in engines.values()
        for r in e.requests
        if "token_ids" in r["body"]
    ]
    assert len(set(engine_ids)) == 2 and "shared-id" not in engine_ids
    (aborted,) = [rid for e in engines.values() for rid in e.aborted]
    assert aborted in {f"generate-tokens-{rid}" for rid in engine_ids}


def test_client_disconnect_mid_stream_aborts_on_the_engine(engines, render_url):
    for name in ("d1", "d2"):
        engines[name].behavior.token_delay_s = 0.2
    body = {"model": MODEL, "prompt": SHORT, "max_tokens": 50, "stream": True}
    with proxy(engines, render=[render_url]) as (base, _):
        with httpx.stream(
            "POST", f"{base}/v1/completions", json=body, headers={"X-Request-Id": "gone-1"}
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break
        wait_until(lambda: any(e.aborted for e in engines.values()))
    (decode,) = [e for e in engines.values() if e.aborted]
    (sent_to,) = [r for r in decode.requests if "token_ids" in r["body"]]
    assert decode.aborted == ["generate-tokens-" + sent_to["headers"]["x-request-id"]]
    wait_until(lambda: decode.disconnects == 1)  # and its stream was closed


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_token_events_that_arrive_together_are_derendered_in_one_call(render_url, tokenizer, route):
    """Engine events that arrived while a derender call was in flight go to the render
    server as one chunk: one call instead of one per token, the same text for the client,
    and what is not a token chunk ([DONE]) passes through in its place."""
    body: dict = {"model": MODEL, "max_tokens": 6, "stream": True}
    if route == "chat":
        body["messages"] = [{"role": "user", "content": SHORT}]
    else:
        body["prompt"] = SHORT
    path = "/v1/chat/completions/render" if route == "chat" else "/v1/completions/render"
    rendered = httpx.post(render_url + path, json=body, timeout=30).json()
    tokens = TokenRequest.from_render(rendered[0] if isinstance(rendered, list) else rendered, True)
    ids = [450, 4996, 17354, 1701, 29916, 432]
    events = [
        "data: "
        + json.dumps(
            {
                "request_id": "generate-tokens-x",
                "choices": [
                    {"index": 0, "token_ids": [i], "finish_reason": "length" if n == 5 else None}
                ],
            }
        )
        + "\n\n"
        for n, i in enumerate(ids)
    ] + ["data: [DONE]\n\n"]

    async def derender(burst: bool) -> tuple[list[str], int]:
        tier = RenderTier(
            (render_url,), timeout_s=30, connect_s=3, max_connections=4, stream_calls=False
        )
        calls = 0
        call = tier.call

        async def counted(*args, **kwargs):
            nonlocal calls
            calls += 1
            return await call(*args, **kwargs)

        tier.call = counted  # type: ignore[method-assign]
        stream = DerenderStream(tier, route, body, tokens, "r1")
        pieces = ["".join(events)] if burst else events
        out = b"".join([await stream.feed(p.encode()) for p in pieces])
        await tier.close()
        return out.decode().split("\n\n")[:-1], calls

    one_by_one, calls = asyncio.run(derender(burst=False))
    together, burst_calls = asyncio.run(derender(burst=True))
    assert (calls, burst_calls) == (6, 1)
    assert together[-1] == one_by_one[-1] == "data: [DONE]"

    def text(lines: list[str]) -> str:
        chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        if route == "chat":
            return "".join(
                c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
            )
        return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])

    assert text(together) == text(one_by_one) == tokenizer.decode(ids)
    finish = [json.loads(x[6:])["choices"][0]["finish_reason"] for x in together[:-1]]
    assert finish[-1] == "length"


def test_only_runs_of_plain_token_chunks_of_one_choice_coalesce():
    def event(choice: dict, **top) -> bytes:
        return b"data: " + json.dumps({"request_id": "g", "choices": [choice], **top}).encode()

    tok = {"index": 0, "token_ids": [1], "finish_reason": None}
    done = {"index": 0, "token_ids": [2], "finish_reason": "stop", "stop_reason": None}
    other = {"index": 1, "token_ids": [3], "finish_reason": None}
    experts = {**tok, "routed_experts": "abc"}
    with_logprobs = {**tok, "logprobs": {"content": [{"token_id": 1, "logprob": -0.5}]}}
    out = coalesce([event(tok), event(tok), event(done), event(tok), b"data: [DONE]"])
    assert [c["choices"][0]["token_ids"] if isinstance(c, dict) else c for c in out] == [
        [1, 1, 2],
        [1],  # after a finished choice: its own
        b"data: [DONE]",
    ]
    assert len(coalesce([event(tok), event(other)])) == 2  # another choice
    assert len(coalesce([event(tok), event(experts)])) == 2  # a key that does not append
    assert len(coalesce([event(tok), event(with_logprobs)])) == 2  # logprobs on one side only
    (both,) = coalesce([event(with_logprobs), event(with_logprobs)])
    assert isinstance(both, dict) and len(both["choices"][0]["logprobs"]["content"]) == 2
    assert len(coalesce([event(tok), event(tok, usage={"prompt_tokens": 1})])) == 2


#: A prompt short enough to be served colocated, long enough (its ids) that the fake
#: generate route's answer to a continuation goes on as an uninterrupted one would.
COLOCATED = "tell me about the sea and the sky"


def _stream_events(base: str, route: str, body: dict) -> list:
    """The stream's events, parsed (``[DONE]`` as the string)."""
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    with httpx.stream("POST", base + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        return [
            json.loads(line[6:]) if line.startswith("data: {") else line[6:]
            for line in r.iter_lines()
            if line.startswith("data: ")
        ]


def _stream_text(events: list, route: str) -> str:
    out = []
    for e in events:
        for c in e.get("choices", []) if isinstance(e, dict) else []:
            out.append(
                (c.get("delta") or {}).get("content") or "" if route == "chat" else c["text"]
            )
    return "".join(out)


def _die_once(engines, after: int) -> None:
    """The next generate stream from either decode instance breaks after ``after`` tokens."""
    engines["d1"].behavior = engines["d2"].behavior = Behavior(
        die_after_tokens=after, die_once=True
    )


@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize("prompt", [COLOCATED, LONG], ids=["colocated", "split"])
def test_a_token_mode_stream_broken_mid_way_is_continued_on_another_instance(
    engines, render_url, tokenizer, route, prompt
):
    """The decode leg's generate stream breaks after 3 of 8 tokens: the proxy sends another
    instance a generate request of the prompt's ids and the 3 generated, for the 5 left,
    colocated, and derenders its tokens on as one answer: the client's events read as an
    uninterrupted run's, with one id, one finish and the whole answer's usage."""
    body: dict = {
        "model": MODEL,
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if route == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    prompt_ids = _render(render_url, route, body)
    expected = _expected(prompt_ids, 8)
    with proxy(engines, render=[render_url], max_migrations=1) as (base, _):
        whole = _stream_events(base, route, body)
        for engine in engines.values():
            engine.requests.clear()
        _die_once(engines, 3)
        moved = _stream_events(base, route, body)
        assert metric(base, "vllm_pd_migrations_total", outcome="continued") == 1
        wait_until(lambda: metric(base, "vllm_pd_requests_total", outcome="ok") == 2)
    assert moved[-1] == "[DONE]" and not any("error" in e for e in moved if isinstance(e, dict))
    assert _stream_text(moved, route) == _stream_text(whole, route) == tokenizer.decode(expected)
    chunks = [e for e in moved if isinstance(e, dict)]
    assert len({(c["id"], c["object"], c["model"]) for c in chunks}) == 1
    finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert finishes == ["length"]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 8
    assert chunks[-1]["usage"]["prompt_tokens"] == len(prompt_ids)
    if route == "chat":
        roles = [ch["delta"].get("role") for c in chunks for ch in c["choices"]]
        assert [r for r in roles if r] == ["assistant"]
    # the continuation: the prompt's ids and the three generated, for the five left
    legs = [r["body"] for d in ("d1", "d2") for r in engines[d].requests if r["body"]["stream"]]
    (cont,) = [leg for leg in legs if len(leg["token_ids"]) > len(prompt_ids)]
    assert cont["token_ids"] == prompt_ids + expected[:3]
    assert cont["sampling_params"]["max_tokens"] == 5
    assert cont["kv_transfer_params"] == {}


def test_a_token_mode_stream_broken_before_its_first_token_is_sent_again_whole(
    engines, render_url, tokenizer
):
    body = {"model": MODEL, "prompt": COLOCATED, "max_tokens": 6, "stream": True}
    prompt_ids = _render(render_url, "completions", body)
    with proxy(engines, render=[render_url], max_migrations=1) as (base, _):
        _die_once(engines, 0)
        moved = _stream_events(base, "completions", body)
        assert metric(base, "vllm_pd_migrations_total", outcome="continued") == 1
    assert moved[-1] == "[DONE]" and not any("error" in e for e in moved if isinstance(e, dict))
    assert _stream_text(moved, "completions") == tokenizer.decode(_expected(prompt_ids, 6))
    legs = [r["body"] for d in ("d1", "d2") for r in engines[d].requests]
    assert [leg["token_ids"] for leg in legs] == [prompt_ids, prompt_ids]
    assert [leg["sampling_params"]["max_tokens"] for leg in legs] == [6, 6]


def test_a_token_mode_stream_is_not_continued_with_migration_off(engines, render_url):
    body = {"model": MODEL, "prompt": COLOCATED, "max_tokens": 6, "stream": True}
    with proxy(engines, render=[render_url], max_migrations=0) as (base, _):
        _die_once(engines, 2)
        events = _stream_events(base, "completions", body)
    assert events[-1]["error"]["code"] == 502
    assert len([r for d in ("d1", "d2") for r in engines[d].requests]) == 1


def test_a_token_mode_stream_broken_after_its_last_token_is_ended_by_the_proxy(
    engines, render_url, tokenizer
):
    """The engine dies after its finish, before the usage and ``[DONE]``: nothing is left
    to generate, so no engine is asked again; the proxy's usage goes through the derender
    as the engine's would."""
    body = {
        "model": MODEL,
        "prompt": COLOCATED,
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    prompt_ids = _render(render_url, "completions", body)
    with proxy(engines, render=[render_url], max_migrations=1) as (base, _):
        _die_once(engines, 5)
        events = _stream_events(base, "completions", body)
        assert metric(base, "vllm_pd_migrations_total", outcome="finished") == 1
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    assert _stream_text(events, "completions") == tokenizer.decode(_expected(prompt_ids, 5))
    assert events[-2]["choices"] == []
    assert events[-2]["usage"]["completion_tokens"] == 5
    assert events[-2]["usage"]["prompt_tokens"] == len(prompt_ids)
    assert len([r for d in ("d1", "d2") for r in engines[d].requests]) == 1


def test_a_client_gone_after_a_token_mode_migration_aborts_the_continuation(engines, render_url):
    """The continuation keeps the request's engine id: the abort sent when the client
    leaves names it on the instance that now streams it."""
    _die_once(engines, 2)
    for engine in engines.values():  # the decodes share one Behavior
        engine.behavior.token_delay_s = 0.1
    body = {"model": MODEL, "prompt": COLOCATED, "max_tokens": 50, "stream": True}
    with proxy(engines, render=[render_url], max_migrations=1) as (base, _):
        with httpx.stream("POST", f"{base}/v1/completions", json=body) as r:
            texts = 0
            for line in r.iter_lines():
                texts += line.startswith("data: {")
                if texts == 5:  # two from the first leg, three from the continuation
                    break
        assert metric(base, "vllm_pd_migrations_total", outcome="continued") == 1
        # the first leg, then the continuation: the prompt's ids and the two generated
        (first, _), (cont, engine) = sorted(
            ((q, e) for e in engines.values() for q in e.requests),
            key=lambda leg: len(leg[0]["body"]["token_ids"]),
        )
        rid = "generate-tokens-" + cont["headers"]["x-request-id"]
        wait_until(lambda: rid in engine.aborted)
    assert cont["headers"]["x-request-id"] == first["headers"]["x-request-id"]
    assert len(cont["body"]["token_ids"]) == len(first["body"]["token_ids"]) + 2
