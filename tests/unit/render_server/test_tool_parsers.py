"""Tool-call parsers: batch results equal vLLM's own parsers; streaming equals batch."""

from __future__ import annotations

import json

import pytest

from tests.skips import requires
from vllm_pd_ext.render_server.parsers import TOOL_PARSERS
from vllm_pd_ext.render_server.parsers.base import ChatParser
from vllm_pd_ext.render_server.parsers.buffered import DS_CALL_BEGIN, DS_CALL_END, DS_CALLS_BEGIN
from vllm_pd_ext.render_server.parsers.buffered import DS_SEP as SEP

DS_END = DS_CALLS_BEGIN.replace("begin", "end")


def _ds_call(name: str, args: str) -> str:
    return f"{DS_CALL_BEGIN}function{SEP}{name}\n```json\n{args}\n```{DS_CALL_END}"


OUTPUTS = {
    "hermes": [
        "plain text, no call",
        'Sure.<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"x": "ü"}}</tool_call>\n'
        '<tool_call>{"name": "g", "arguments": {}}</tool_call>',
        "<tool_call>not json</tool_call>",
    ],
    "llama3_json": [
        "plain text, no call",
        '{"name": "f", "parameters": {"a": 1}}',
        '<|python_tag|>{"name": "f", "arguments": {"x": "ü"}}; {"name": "g", "arguments": {}}',
        '{"name": "f"}',
        "Text then {not json",
    ],
    "deepseek_v3": [
        "plain text, no call",
        f"Let me look.{DS_CALLS_BEGIN}{_ds_call('f', json.dumps({'a': 1}))}{DS_END}",
        DS_CALLS_BEGIN + _ds_call("f", "{}") + _ds_call("g", '{"b": [1]}') + DS_END,
    ],
}


def _vllm_parser(name: str, tiny_llama):
    from transformers import AutoTokenizer
    from vllm.tool_parsers import ToolParserManager

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    tok.add_tokens(
        [
            "<tool_call>",
            "</tool_call>",
            "<|python_tag|>",
            DS_CALLS_BEGIN,
            DS_END,
            DS_CALL_BEGIN,
            DS_CALL_END,
            SEP,
        ]
    )
    return ToolParserManager.get_tool_parser(name)(tok)


@requires("vllm", why="vLLM's parsers are the reference for this check")
@pytest.mark.parametrize("name", list(OUTPUTS))
def test_batch_equals_vllm(name, tiny_llama):
    ref = _vllm_parser(name, tiny_llama)
    ours = TOOL_PARSERS[name](None)
    for text in OUTPUTS[name]:
        result = ref.extract_tool_calls(text, request=None)
        want_calls = [(c.function.name, c.function.arguments) for c in result.tool_calls]
        calls, content = ours.extract(text, text)
        assert [(c["name"], c["arguments"]) for c in calls] == want_calls, text
        assert content == result.content, text


@pytest.mark.parametrize("name", list(OUTPUTS))
@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_streaming_equals_batch(name, size):
    parser = ChatParser(None, TOOL_PARSERS[name](None))
    for text in OUTPUTS[name]:
        _, want_content, want_calls = parser.parse(text, [], None)
        state = parser.initial_state([])
        content, calls = "", []
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        for i, piece in enumerate(pieces):
            delta, state = parser.parse_delta(state, piece, [], finished=i == len(pieces) - 1)
            json.dumps(state)  # the state travels as JSON
            content += delta.get("content") or ""
            calls += [c["function"] for c in delta.get("tool_calls") or []]
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c["name"], c["arguments"]) for c in want_calls
        ], text
        assert content == (want_content or ""), text


DEEP = "[" * 100_000  # deeper than Python's recursion limit: the JSON decoder gives up

NESTED_OUTPUTS = {
    "hermes": f"<tool_call>{DEEP}</tool_call>",
    "llama3_json": f'{{"name": "f", "parameters": {DEEP}',
    "deepseek_v3": DS_CALLS_BEGIN + _ds_call("f", DEEP) + DS_END,
}


@pytest.mark.parametrize("name", list(NESTED_OUTPUTS))
def test_deeply_nested_brackets_are_text_not_an_error(name):
    """Output nested past the recursion limit (a caller of derender chooses the tokens) is
    parsed, batch and streamed, without an exception (the render server's 500): text, or a
    call whose arguments are that text where the parser passes arguments through unparsed."""
    parser = ChatParser(None, TOOL_PARSERS[name](None))
    text = NESTED_OUTPUTS[name]
    _, content, calls = parser.parse(text, [], None)
    assert content or calls
    delta, _ = parser.parse_delta(parser.initial_state([]), text, [], finished=True)
    assert delta.get("content") or delta.get("tool_calls")
