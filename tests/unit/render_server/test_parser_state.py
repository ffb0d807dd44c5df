"""A carried ``stream_state`` is checked before the server reads it.

``stream_state.parser_state`` against the configured parser's declared shape: each forgery
(a wrong type, an unknown or missing key, an oversize buffer, an index out of range, deep
nesting, a huge list) is a 400 naming it, for every parser that carries state; the states real
streams produce pass. The other lists and strings of ``stream_state`` are bounded too.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.skips import requires
from tests.unit.render_server.helpers import derender_chat_stream
from vllm_pd_ext.render_server.app import create_app
from vllm_pd_ext.render_server.parsers.buffered import (
    DS_CALL_BEGIN,
    DS_CALL_END,
    DS_CALLS_BEGIN,
    DS_SEP,
)
from vllm_pd_ext.render_server.parsers.state import StateLimits
from vllm_pd_ext.render_server.settings import RenderSettings
from vllm_pd_ext.render_server.tokenizer import load_tokenizer

MAX_MODEL_LEN = 256
PARAM = "stream_state.parser_state"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
MESSAGES = [{"role": "user", "content": "weather?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
#: a huge list: a million entries, far past every bound, cheap to refuse
HUGE = [0] * 1_000_000


def _nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth):
        value = {"a": value}
    return value


#: deep nesting: well inside what the JSON decoders accept
NEST = _nested(200)


def _over_text(limits: StateLimits) -> str:
    """One character more than any text a state may hold."""
    return "x" * (limits.max_text + 1)


def _over_token(limits: StateLimits) -> str:
    """One character more than the longest token's text."""
    return "x" * (limits.max_token_text + 1)


def _over_count(limits: StateLimits) -> int:
    """One more than the output's tokens."""
    return limits.max_tokens + 1


def _over_length(limits: StateLimits) -> int:
    """One more than the output's characters."""
    return limits.max_text + 1


#: a key to remove instead of a value to set
DROP = object()

Path = tuple[Any, ...]
Value = Any  # a value, a function of the limits giving one, or DROP
Forgery = list[tuple[Path, Value]]


@dataclass(frozen=True)
class Case:
    """One parser configuration, an output cut in two, and forgeries of the state after the
    first part (the second part then arrives with the forged state)."""

    model: str  # the fixture giving the model directory
    settings: dict[str, Any]
    chat_request: dict[str, Any]
    head: str
    tail: str
    forgeries: dict[str, Forgery]
    env: dict[str, str] = field(default_factory=dict)
    prompt_token_ids: tuple[int, ...] = (1, 2)


def _buffered_forgeries(marker_len: int) -> dict[str, Forgery]:
    """Forgeries of a :class:`BufferedToolParser` state read mid-call."""
    return {
        "wrong type": [(("tools", "in_calls"), "yes")],
        "extra key": [(("tools", "extra"), 0)],
        "missing key": [(("tools", "seen"), DROP)],
        "oversize buffer": [(("tools", "buf"), _over_text)],
        "oversize buffer outside the calls": [
            (("tools", "in_calls"), False),
            (("tools", "buf"), "x" * marker_len),
        ],
        "deep nesting": [(("tools", "buf"), NEST)],
        "huge list": [(("tools", "buf"), HUGE)],
    }


HERMES = {"reasoning_parser": "deepseek_r1", "tool_call_parser": "hermes"}
JSON_MODE = {"VLLM_ENFORCE_STRICT_TOOL_CALLING": "0"}

CASES: dict[str, Case] = {
    "hermes": Case(
        "tiny_qwen_think",
        HERMES,
        {"messages": MESSAGES, "tools": TOOLS},
        '<think>hmm</think>Sure.<tool_call>\n{"name": "get_weather", ',
        '"arguments": {"city": "Zürich"}}\n</tool_call>',
        {
            "wrong type": [(("tools", "in_call"), 1)],
            "wrong type of a reasoning key": [(("reasoning_ended",), "yes")],
            "extra key": [(("tools", "extra"), 0)],
            "extra key at the top": [(("extra",), 0)],
            "missing key": [(("tools", "called"), DROP)],
            "oversize buffer": [(("tools", "buf"), _over_text)],
            "oversize buffer outside a call": [
                (("tools", "in_call"), False),
                (("tools", "buf"), "x" * len("<tool_call>")),
            ],
            "negative index": [(("tools", "index"), -1)],
            "index past the limit": [(("tools", "index"), _over_count)],
            "index past the carried ids": [(("tools", "index"), 3)],
            "deep nesting": [(("tools", "buf"), NEST)],
            "huge list": [(("tools", "buf"), HUGE)],
        },
    ),
    "qwen3 text markers": Case(
        "tiny_qwen",
        {"reasoning_parser": "qwen3"},
        {"messages": MESSAGES},
        "<think>abc de",
        "f</think>Answer.",
        {
            "wrong type": [(("seen_start",), 1)],
            "extra key": [(("extra",), 0)],
            "missing key": [(("reasoning_ended",), DROP)],
            "oversize buffer": [(("pending",), "x" * len("</think>"))],
            "deep nesting": [(("pending",), NEST)],
            "huge list": [(("pending",), HUGE)],
        },
    ),
    "llama3_json": Case(
        "tiny_qwen",
        {"tool_call_parser": "llama3_json"},
        {"messages": MESSAGES, "tools": TOOLS},
        '{"name": "get_weather", "param',
        'eters": {"city": "Zürich"}}',
        _buffered_forgeries(len("<|python_tag|>")),
    ),
    "deepseek_v3": Case(
        "tiny_qwen",
        {"tool_call_parser": "deepseek_v3"},
        {"messages": MESSAGES, "tools": TOOLS},
        f'{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}get_weather\n```json\n{{"ci',
        f'ty": "Zürich"}}\n```{DS_CALL_END}',
        _buffered_forgeries(len(DS_CALLS_BEGIN)),
    ),
    "mistral": Case(
        "tiny_mistral",
        {"tool_call_parser": "mistral"},
        {"messages": MESSAGES, "tools": TOOLS},
        'Sure.[TOOL_CALLS]get_weather[ARGS]{"ci',
        'ty": "Zürich"}',
        {
            "wrong type": [(("tools", "mode"), "elsewhere")],
            "wrong type of a flag": [(("tools", "nonws"), 1)],
            "extra key": [(("tools", "extra"), 0)],
            "missing key": [(("tools", "index"), DROP)],
            "oversize buffer": [(("tools", "args"), _over_text)],
            "oversize special-token text": [(("tools", "drop_held"), _over_token)],
            "negative index": [(("tools", "index"), -1)],
            "index past the limit": [(("tools", "index"), _over_count)],
            "index past the carried ids": [(("tools", "index"), 3)],
            "deep nesting": [(("tools", "name"), NEST)],
            "huge list": [(("tools", "args"), HUGE)],
        },
    ),
    "mistral pre-v11": Case(
        "tiny_mistral_v3",
        {"tool_call_parser": "mistral"},
        {"messages": MESSAGES, "tools": TOOLS},
        'Sure.[TOOL_CALLS][{"name": "get_weather", "argu',
        'ments": {"city": "Zürich"}}]',
        _buffered_forgeries(len("[TOOL_CALLS]")),
    ),
    "named": Case(
        "tiny_qwen_think",
        HERMES,
        {"messages": MESSAGES, "tools": TOOLS, "tool_choice": NAMED},
        '<think></think>{"city": "Z',
        'ürich"}',
        {
            "wrong type": [(("tools", "sent"), 1)],
            "extra key": [(("tools", "extra"), 0)],
            "missing key": [(("tools", "sent"), DROP)],
            "deep nesting": [(("tools", "sent"), NEST)],
            "huge list": [(("tools", "sent"), HUGE)],
        },
        env=JSON_MODE,
    ),
    "required": Case(
        "tiny_qwen_think",
        HERMES,
        {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required"},
        '<think></think>[{"name": "get_weather", "parameters": {"ci',
        'ty": "Zürich"}}]',
        {
            "wrong type": [(("tools", "in_string"), 1)],
            "extra key": [(("tools", "cur", "extra"), 0)],
            "oversize buffer": [(("tools", "cur", "args"), _over_text)],
            "a name that is not a string": [
                (("tools", "expect"), 3),
                (("tools", "key"), "name"),
                (("tools", "strbuf"), "[" * 5000),
            ],
            "scanner state out of range": [(("tools", "expect"), 9)],
            "negative index": [(("tools", "index"), -2)],
            "index past the limit": [(("tools", "index"), _over_length)],
            "index past the carried ids": [(("tools", "index"), 3)],
            "negative depth": [(("tools", "depth"), -1)],
            "deep nesting": [(("tools", "key"), NEST)],
            "huge list": [(("tools", "cur", "args"), HUGE)],
        },
        env=JSON_MODE,
    ),
    "vllm source": Case(
        "tiny_qwen",
        {"tool_call_parser": "pythonic", "parser_source": "vllm"},
        {"messages": MESSAGES, "tools": TOOLS},
        '[get_weather(city="Zü',
        'rich")]',
        {
            "wrong type": [(("texts", 0), 5)],
            "extra key": [(("extra",), 0)],
            "oversize buffer": [(("texts", 0), _over_text)],
            "negative token id": [(("token_ids", 0, 0), -1)],
            "token id past u32": [(("token_ids", 0, 0), 2**32)],
            "deep nesting": [(("texts", 0), NEST)],
            "huge list": [(("texts",), [""] * 1_000_000), (("token_ids",), [[0]] * 1_000_000)],
        },
    ),
}


def _case_params(cases: dict[str, Case]) -> list[Any]:
    marks = {"vllm source": requires("vllm", why="vLLM's parser registry")}
    return [pytest.param(name, marks=marks.get(name, ()), id=name) for name in cases]


@pytest.fixture(scope="module")
def servers(request) -> Iterator[Callable[[Case], tuple[TestClient, StateLimits]]]:
    """A render server per parser configuration (built once per module) and the limits its
    stream states are held to."""
    made: dict[tuple[str, str], tuple[TestClient, StateLimits]] = {}

    def get(case: Case) -> tuple[TestClient, StateLimits]:
        key = (case.model, repr(sorted(case.settings.items())))
        if key not in made:
            model = str(request.getfixturevalue(case.model))
            settings = RenderSettings(
                model=model,
                max_model_len=MAX_MODEL_LEN,
                enable_auto_tool_choice=True,
                fast_bpe=False,
                **case.settings,
            )
            client = TestClient(create_app(settings))
            client.__enter__()
            token_text = load_tokenizer(model, None).max_chars_per_token
            made[key] = client, StateLimits.for_model(MAX_MODEL_LEN, token_text)
        return made[key]

    yield get
    for client, _ in made.values():
        client.__exit__(None, None, None)


def _ids(client: TestClient, text: str) -> list[int]:
    resp = client.post("/v1/completions/render", json={"prompt": text, "add_special_tokens": False})
    assert resp.status_code == 200, resp.text
    return resp.json()[0]["token_ids"]


def _chunk(case: Case, ids: list[int], state: Any, *, last: bool) -> dict[str, Any]:
    return {
        "stream": True,
        "generate_chunk": {
            "choices": [{"token_ids": ids, "finish_reason": "stop" if last else None}]
        },
        "stream_state": state,
        "chat_request": case.chat_request,
        "prompt_token_ids": list(case.prompt_token_ids),
    }


def _forge(state: dict[str, Any], forgery: Forgery, limits: StateLimits) -> dict[str, Any]:
    forged = copy.deepcopy(state)
    for path, value in forgery:
        *parents, last = path
        node = forged
        for part in parents:
            node = node[part]
        if value is DROP:
            assert last in node, f"the state has no {path} to drop"
            del node[last]
        else:
            node[last] = value(limits) if callable(value) else value
    return forged


FORGERIES = [
    pytest.param(name, forgery, marks=param.marks, id=f"{name}: {forgery}")
    for param in _case_params(CASES)
    for name in param.values
    for forgery in CASES[name].forgeries
]


@pytest.mark.parametrize(("case_name", "forgery"), FORGERIES)
def test_a_forged_parser_state_is_a_400_naming_it(servers, monkeypatch, case_name, forgery):
    case = CASES[case_name]
    for name, value in case.env.items():
        monkeypatch.setenv(name, value)
    client, limits = servers(case)
    head = client.post(
        "/v1/chat/completions/derender",
        json=_chunk(case, _ids(client, case.head), None, last=False),
    )
    assert head.status_code == 200, head.text
    state = head.json()["stream_state"]
    tail = _chunk(case, _ids(client, case.tail), state, last=True)
    # the state as the server answered it carries on (the forgery is what is refused)
    assert client.post("/v1/chat/completions/derender", json=tail).status_code == 200

    forged = _forge(state["parser_state"], case.forgeries[forgery], limits)
    resp = client.post(
        "/v1/chat/completions/derender",
        json={**tail, "stream_state": {**state, "parser_state": forged}},
    )
    assert resp.status_code == 400, resp.text[:500]
    error = resp.json()["error"]
    assert error["param"] == PARAM
    assert error["type"] == "BadRequestError"
    assert len(resp.content) < 4096  # the forged value is not echoed back


def _assembled(client: TestClient, case: Case, ids: list[int], size: int) -> tuple[Any, ...]:
    reasoning = content = ""
    calls: dict[int, dict[str, str]] = {}
    answers = derender_chat_stream(
        client, ids, size, case.chat_request, list(case.prompt_token_ids)
    )
    for answer in answers:
        delta = answer["chunk"]["choices"][0]["delta"]
        reasoning += delta.get("reasoning") or ""
        content += delta.get("content") or ""
        for tc in delta.get("tool_calls") or []:
            call = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
            call["name"] += tc["function"].get("name") or ""
            call["arguments"] += tc["function"].get("arguments") or ""
    assert all(a["stream_state"]["parser_state"] is not None for a in answers)
    return reasoning.removeprefix("<think>"), content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("case_name", _case_params(CASES))
@pytest.mark.parametrize("size", [1, 3])
def test_a_stream_carries_its_own_states_through_the_check(servers, monkeypatch, case_name, size):
    """Every state a real stream produced passes the check of the next call, and the stream
    gives what batch derender gives for the same output."""
    case = CASES[case_name]
    for name, value in case.env.items():
        monkeypatch.setenv(name, value)
    client, _ = servers(case)
    ids = _ids(client, case.head) + _ids(client, case.tail)
    batch = client.post(
        "/v1/chat/completions/derender",
        json={
            "generate_response": {"choices": [{"token_ids": ids, "finish_reason": "stop"}]},
            "chat_request": case.chat_request,
            "prompt_token_ids": list(case.prompt_token_ids),
        },
    )
    assert batch.status_code == 200, batch.text
    message = batch.json()["choices"][0]["message"]
    calls = [tc["function"] for tc in message.get("tool_calls") or []]
    assert calls or "tools" not in case.chat_request  # the output does make a call
    reasoning, content, streamed_calls = _assembled(client, case, ids, size)
    assert streamed_calls == calls
    # None and "" alike: the batch message has "" where a stream sends nothing
    assert content == (message["content"] or "")
    assert reasoning == (message["reasoning"] or "")


# ---- the rest of stream_state -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("carried", "param"),
    [
        pytest.param(
            {"last_tool_call_ids": ["chatcmpl-tool-0"] * 1_000_000},
            "stream_state.last_tool_call_ids",
            id="a million tool call ids",
        ),
        pytest.param(
            {"last_tool_call_ids": ["x" * 257]},
            "body.stream_state.last_tool_call_ids.0",
            id="an oversize tool call id",
        ),
        pytest.param(
            {"prev_tokens": ["x" * 100_000], "prefix_offset": 0, "read_offset": 1},
            "stream_state.prev_tokens",
            id="a window entry longer than any token",
        ),
        pytest.param(
            {"output_token_ids": HUGE, "output_chunk_lens": [len(HUGE)]},
            "stream_state.output_token_ids",
            id="a million replay ids",
        ),
        pytest.param(
            {"output_token_ids": [1, 2], "output_chunk_lens": [5]},
            "body.stream_state",
            id="replay chunks that do not cover the replay ids",
        ),
        pytest.param(
            {"logprob_context_token_ids": [-1]},
            "body.stream_state.logprob_context_token_ids.0",
            id="a negative context token id",
        ),
    ],
)
def test_the_other_stream_state_lists_are_bounded(servers, carried, param):
    case = CASES["hermes"]
    client, _ = servers(case)
    body = _chunk(case, _ids(client, "Sure."), carried, last=False)
    resp = client.post("/v1/chat/completions/derender", json=body)
    assert resp.status_code == 400, resp.text[:500]
    assert resp.json()["error"]["param"] == param
    assert len(resp.content) < 4096
