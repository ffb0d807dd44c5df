"""The ``mistral`` tool parser: batch and streaming, both formats, vLLM's parser as reference."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.skips import requires
from tests.unit.render_server.helpers import derender_chat_stream
from vllm_pd_ext.render_server.app import create_app
from vllm_pd_ext.render_server.errors import RenderError
from vllm_pd_ext.render_server.parsers import TOOL_PARSERS
from vllm_pd_ext.render_server.parsers.base import ChatParser
from vllm_pd_ext.render_server.parsers.mistral import (
    MistralLegacyToolParser,
    MistralToolParser,
    mistral_tool_parser,
)
from vllm_pd_ext.render_server.settings import RenderSettings
from vllm_pd_ext.render_server.tokenizer import load_tokenizer

TC, ARGS = "[TOOL_CALLS]", "[ARGS]"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]

#: v11+ outputs: (text, content, [(name, arguments), ...]) as vLLM's batch parse gives them.
V11_CASES = [
    ("plain text, no call", "plain text, no call", []),
    (
        f'Sure.{TC}get_weather{ARGS}{{"city": "Zürich"}}',
        "Sure.",
        [("get_weather", '{"city": "Zürich"}')],
    ),
    (f'{TC}f{ARGS}{{"a": 1}}{TC}g{ARGS}{{}}', None, [("f", '{"a": 1}'), ("g", "{}")]),
    (f'  {TC}f{{"a": {{"b": [1, 2]}}}}', None, [("f", '{"a": {"b": [1, 2]}}')]),
    (f'{TC}f{ARGS}{{"a": 1}} trailing text', None, [("f", '{"a": 1}')]),
    (f"{TC}f{ARGS}not json ", None, [("f", "not json")]),
    (f"{TC}f{ARGS}", None, [("f", "{}")]),
    (f"Hi {TC}", "Hi ", []),
    (f"  {TC}", None, []),
    (f"Hi {TC}f{ARGS}{{}}", "Hi", [("f", "{}")]),
    (f"{TC} f \n{ARGS} [1, 2] ", None, [("f", "[1, 2]")]),
    (f"{TC}f{TC}g{ARGS}{{}}", None, [(f"f{TC}g", "{}")]),
    (f"{TC}f{ARGS}{{}}{ARGS}{{}}", None, [("f", "{}")]),
    (f'{TC}{{"a": "}}"}}', None, [("", '{"a": "}"}')]),
    (f'x{TC}f{ARGS}{{}}{TC}g{{"b": 2}}y{TC}', "x", [("f", "{}"), ("g", '{"b": 2}')]),
]
#: pre-v11 outputs.
LEGACY_CASES = [
    ("plain", "plain", []),
    (f'Hi {TC}[{{"name": "f", "arguments": {{"a": "ü"}}}}]', "Hi ", [("f", '{"a": "ü"}')]),
    (
        f'{TC} [{{"name": "f", "arguments": {{}}}}, {{"name": "g", "arguments": "x"}}] tail',
        None,
        [("f", "{}"), ("g", "x")],
    ),
    (f'{TC}{{"name": "f"}}', None, [("f", "{}")]),
    (f"{TC}not json", "not json", []),
    (f'{TC}{TC}[{{"arguments": {{"b": [1]}}}}]', None, [("", '{"b": [1]}')]),
]


def _chunks(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


def _stream(parser: ChatParser, pieces: list[str]) -> tuple[str, list[tuple[str, str]], list]:
    state = parser.initial_state([])
    content, calls, indices = "", [], []
    for i, piece in enumerate(pieces):
        delta, state = parser.parse_delta(state, piece, [], finished=i == len(pieces) - 1)
        state = json.loads(json.dumps(state))  # the state travels as JSON
        content += delta.get("content") or ""
        for c in delta.get("tool_calls") or []:
            calls.append((c["function"]["name"], c["function"]["arguments"]))
            indices.append(c["index"])
    return content, calls, indices


@pytest.mark.parametrize(("text", "content", "calls"), V11_CASES)
def test_v11_batch(text, content, calls):
    got_calls, got_content = MistralToolParser().extract(text, text)
    assert [(c["name"], c["arguments"]) for c in got_calls] == calls
    assert got_content == content


@pytest.mark.parametrize(("text", "content", "calls"), LEGACY_CASES)
def test_legacy_batch(text, content, calls):
    got_calls, got_content = MistralLegacyToolParser().extract(text, text)
    assert [(c["name"], c["arguments"]) for c in got_calls] == calls
    assert got_content == content


@pytest.mark.parametrize("size", [1, 2, 3, 5, 11, 1000])
@pytest.mark.parametrize(("text", "content", "calls"), V11_CASES)
def test_v11_stream_gives_batch_calls(text, content, calls, size):
    content_s, calls_s, indices = _stream(
        ChatParser(None, MistralToolParser()), _chunks(text, size)
    )
    assert calls_s == calls
    assert indices == list(range(len(calls)))
    # content streams before the calls are known: vLLM's streaming does not strip it
    if calls:
        assert content_s.strip() == (content or "")
    else:
        assert content_s == (content or "")


def test_v11_stream_emits_each_call_when_it_ends():
    parser = ChatParser(None, MistralToolParser())
    state = parser.initial_state([])
    seen = []
    for piece in ["Hi", f" {TC}f{ARGS}", '{"a": 1}', f"{TC}g", f"{ARGS}{{}}"]:
        delta, state = parser.parse_delta(state, piece, [], finished=False)
        seen.append(delta)
    assert seen[0] == {"content": "Hi"} and seen[1] == {"content": " "}
    assert "tool_calls" not in seen[2]
    assert seen[3]["tool_calls"] == [
        {"index": 0, "function": {"name": "f", "arguments": '{"a": 1}'}}
    ]
    assert len(state["tools"]["args"]) < 10  # only the call being read is kept
    delta, state = parser.parse_delta(state, "", [], finished=True)
    assert delta["tool_calls"] == [{"index": 1, "function": {"name": "g", "arguments": "{}"}}]


def test_v11_whitespace_before_calls_is_dropped_when_streaming():
    content, calls, _ = _stream(ChatParser(None, MistralToolParser()), [" ", "\n", TC, "f", "{}"])
    assert content == "" and calls == [("f", "{}")]
    content, calls, _ = _stream(ChatParser(None, MistralToolParser()), [" ", "\n"])
    assert content == " \n" and calls == []


@pytest.mark.parametrize("size", [1, 4, 1000])
@pytest.mark.parametrize(("text", "content", "calls"), LEGACY_CASES)
def test_legacy_stream_gives_batch_calls(text, content, calls, size):
    _, calls_s, _ = _stream(ChatParser(None, MistralLegacyToolParser()), _chunks(text, size))
    assert calls_s == calls


def test_format_follows_the_tokenizer(tiny_mistral, tiny_mistral_v3, tiny_llama):
    assert isinstance(mistral_tool_parser(load_tokenizer(tiny_mistral, None)), MistralToolParser)
    legacy = mistral_tool_parser(load_tokenizer(tiny_mistral_v3, None))
    assert isinstance(legacy, MistralLegacyToolParser)
    with pytest.raises(RenderError, match="could not locate the tool call token"):
        TOOL_PARSERS["mistral"](load_tokenizer(tiny_llama, None))


def test_ids_are_mistral_ids():
    ids = {ChatParser(None, MistralToolParser()).new_tool_call_id() for _ in range(20)}
    assert len(ids) == 20 and all(len(i) == 9 and i.isalnum() for i in ids)


# ---- the server, end to end ---------------------------------------------------------------


def test_server_derenders_mistral_calls(tiny_mistral):
    settings = RenderSettings(
        model=str(tiny_mistral), tool_call_parser="mistral", enable_auto_tool_choice=True
    )
    text = f'Checking.{TC}get_weather{ARGS}{{"city": "Zürich"}}'
    chat_request = {"messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS}
    with TestClient(create_app(settings)) as client:
        ids = client.post(
            "/v1/completions/render", json={"prompt": text, "add_special_tokens": False}
        ).json()[0]["token_ids"]
        batch = client.post(
            "/v1/chat/completions/derender",
            json={
                "generate_response": {"choices": [{"token_ids": ids, "finish_reason": "stop"}]},
                "chat_request": chat_request,
                "prompt_token_ids": [1],
            },
        ).json()
        streamed, finish = "", None
        calls: list[Any] = []
        for out in derender_chat_stream(client, ids, 3, chat_request, [1]):
            choice = out["chunk"]["choices"][0]
            streamed += choice["delta"]["content"] or ""
            calls += choice["delta"].get("tool_calls") or []
            finish = choice["finish_reason"]
    msg = batch["choices"][0]["message"]
    assert msg["content"] == "Checking."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == [
        ("get_weather", '{"city": "Zürich"}')
    ]
    assert streamed == "Checking."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_weather", '{"city": "Zürich"}')
    ]
    assert len(calls[0]["id"]) == 9 and finish == "tool_calls"


# ---- vLLM's own parser as the reference ---------------------------------------------------

FRAGMENTS = [
    TC,
    TC,
    ARGS,
    "{",
    "}",
    "[",
    "]",
    '"a"',
    ": ",
    ", ",
    "1",
    "f",
    "get_weather",
    " ",
    "\n",
    "Hi",
    "ü",
    '"',
    "\\",
    "null",
    "<|eot_id|>",  # special-token texts: vLLM's v11 parser drops them everywhere
    "<|end_of_text|>",
    "<|eo",
]


LEGACY_FRAGMENTS = [
    TC,
    "[",
    "]",
    '{"name": "f", "arguments": {"a": 1}}',
    '{"name": "g"}',
    '{"arguments": "s"}',
    '"x"',
    ", ",
    " ",
    "Hi",
    "{",
    "}",
    "1",
]


def _random_outputs(n: int, fragments: list[str] = FRAGMENTS) -> list[str]:
    rng = random.Random(4)
    return ["".join(rng.choice(fragments) for _ in range(rng.randint(0, 14))) for _ in range(n)]


def _vllm_reference(model_dir):
    from transformers import AutoTokenizer
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser import ParserManager

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    parser_cls = ParserManager.get_parser(tool_parser_name="mistral", enable_auto_tools=True)
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=TOOLS)
    return tok, parser_cls, request


def _vllm_batch(ref, text):
    tok, parser_cls, request = ref
    _, content, calls = parser_cls(tok, request.tools).parse(
        text, request, enable_auto_tools=True, model_output_token_ids=[]
    )
    return content, [(c.name, c.arguments) for c in calls or []]


def _vllm_stream(ref, pieces):
    tok, parser_cls, request = ref
    parser = parser_cls(tok, request.tools)
    content = ""
    calls: dict[Any, Any] = {}
    for i, piece in enumerate(pieces):
        delta = parser.parse_delta(
            piece, [], request, prompt_token_ids=[], finished=i == len(pieces) - 1
        )
        if delta is None:
            continue
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            call = calls.setdefault(tc.index, ["", ""])
            call[0] += (tc.function.name or "") if tc.function else ""
            call[1] += (tc.function.arguments or "") if tc.function else ""
    return content, [tuple(calls[k]) for k in sorted(calls)]


@requires("vllm", why="vLLM's mistral parser is the reference")
@pytest.mark.parametrize("fmt", ["v11", "legacy"])
def test_batch_equals_vllm(fmt, tiny_mistral, tiny_mistral_v3):
    model = tiny_mistral if fmt == "v11" else tiny_mistral_v3
    ref = _vllm_reference(model)
    ours = mistral_tool_parser(load_tokenizer(model, None))
    cases = [c[0] for c in (V11_CASES if fmt == "v11" else LEGACY_CASES)]
    randoms = _random_outputs(400) if fmt == "v11" else _random_outputs(300, LEGACY_FRAGMENTS)
    for text in cases + randoms:
        want = _vllm_batch(ref, text)
        _, content, calls = ChatParser(None, ours).parse(text, [], None)
        assert (content, [(c["name"], c["arguments"]) for c in calls]) == want, text


@requires("vllm", why="vLLM's mistral parser is the reference")
@pytest.mark.parametrize("size", [1, 3, 1000])
def test_v11_stream_equals_vllm_on_well_formed_output(tiny_mistral, size):
    ref = _vllm_reference(tiny_mistral)
    outputs = [
        "no calls at all ü",
        f'Sure.{TC}get_weather{ARGS}{{"city": "Zürich"}}',
        f'Two: {TC}f{ARGS}{{"a": [1, {{"b": "}}"}}]}}{TC}g{ARGS}{{}}',
        f'  {TC}f{{"x": null}}',
        "ends with eos<|eot_id|>",
        f'<|eot_id|> {TC}g<|end_of_text|>et{ARGS}{{"a": "<|eot_id|>x"}}<|eot_id|>',
        "a<|eot_<|eot_id|>id|>b",
    ]
    ours = mistral_tool_parser(load_tokenizer(tiny_mistral, None))
    assert isinstance(ours, MistralToolParser)
    assert "<|eot_id|>" in ours.drop
    for text in outputs:
        pieces = _chunks(text, size)
        content, calls, _ = _stream(ChatParser(None, ours), pieces)
        assert (content, calls) == _vllm_stream(ref, pieces), text


@requires("vllm", why="vLLM's mistral parser is the reference")
@pytest.mark.parametrize("tools", ["absent", "tool_choice none"])
def test_v11_without_tools_equals_vllm(tiny_mistral, tools):
    """vLLM's v11 parser still runs: special-token text dropped, calls cut and not returned."""
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionRequest as VllmRequest,
    )

    from vllm_pd_ext.render_server.parsers import make_parser
    from vllm_pd_ext.render_server.protocol import ChatCompletionRequest

    tok, parser_cls, _ = _vllm_reference(tiny_mistral)
    body: dict = {"messages": [{"role": "user", "content": "x"}]}
    if tools != "absent":
        body.update(tools=TOOLS, tool_choice="none")
    vllm_request = VllmRequest(**body)
    ours = make_parser(
        load_tokenizer(tiny_mistral, None),
        reasoning=None,
        tools="mistral",
        request=ChatCompletionRequest(**body),
        enable_auto_tools=True,
    )
    for text in [*(c[0] for c in V11_CASES), *_random_outputs(200)]:
        _, content, calls = parser_cls(tok, vllm_request.tools).parse(
            text, vllm_request, enable_auto_tools=True, model_output_token_ids=[]
        )
        assert ours.parse(text, [], None) == (None, content, []), text
        assert calls == [] or tools == "absent"
