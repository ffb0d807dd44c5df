"""``parser_source``: built-in parsers only, or vLLM's registry for the names we lack."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from tests.skips import requires
from tests.unit.render_server.helpers import derender_chat_stream
from vllm_pd_ext.render_server.app import create_app
from vllm_pd_ext.render_server.settings import RenderSettings

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CHAT_REQUEST = {"messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS}
PYTHONIC = '[get_weather(city="Zürich"), get_weather(city="東京")]'


def test_builtin_source_refuses_names_it_lacks(tiny_qwen):
    with pytest.raises(ValidationError, match="parser_source 'vllm'"):
        RenderSettings(model=str(tiny_qwen), tool_call_parser="pythonic")
    settings = RenderSettings(model=str(tiny_qwen), tool_call_parser="hermes", parser_source="vllm")
    assert settings.uses_vllm_parsers is False  # built-in names stay built in


SCRIPT = r"""
import json, sys
sys.modules["vllm"] = None  # any `import vllm...` now raises ImportError
from pydantic import ValidationError
from vllm_pd_ext.render_server.settings import RenderSettings
out = {}
ok = RenderSettings(model=sys.argv[1], tool_call_parser="mistral", parser_source="vllm")
out["builtin_ok"] = not ok.uses_vllm_parsers
try:
    RenderSettings(model=sys.argv[1], tool_call_parser="pythonic", parser_source="vllm")
except ValidationError as exc:
    out["error"] = str(exc)
print(json.dumps(out))
"""


def test_vllm_source_without_vllm_is_a_clear_error(tiny_qwen):
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_qwen)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["builtin_ok"] is True
    assert "vLLM is not installed" in out["error"] and "'pythonic'" in out["error"]


@requires("vllm", why="needs vLLM's parser registry")
def test_vllm_source_unknown_name(tiny_qwen):
    with pytest.raises(ValidationError, match="neither built in nor registered in vLLM"):
        RenderSettings(model=str(tiny_qwen), tool_call_parser="no_such", parser_source="vllm")


def _vllm_reference(model_dir):
    from transformers import AutoTokenizer
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser import ParserManager

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    cls = ParserManager.get_parser(tool_parser_name="pythonic", enable_auto_tools=True)
    request = ChatCompletionRequest.model_validate({**CHAT_REQUEST, "tool_choice": "auto"})
    return tok, cls, request


@requires("vllm", why="needs vLLM's parser registry")
@pytest.mark.parametrize("size", [1, 4, 1000])
def test_vllm_source_parser_batch_and_stream(tiny_qwen, size):
    settings = RenderSettings(
        model=str(tiny_qwen),
        tool_call_parser="pythonic",
        enable_auto_tool_choice=True,
        parser_source="vllm",
    )
    tok, cls, vreq = _vllm_reference(tiny_qwen)
    _, want_content, want_calls = cls(tok, vreq.tools).parse(PYTHONIC, vreq, enable_auto_tools=True)
    want = [(c.name, c.arguments) for c in want_calls]
    assert len(want) == 2  # the reference did find the calls
    with TestClient(create_app(settings)) as client:
        ids = client.post(
            "/v1/completions/render", json={"prompt": PYTHONIC, "add_special_tokens": False}
        ).json()[0]["token_ids"]
        batch = client.post(
            "/v1/chat/completions/derender",
            json={
                "generate_response": {"choices": [{"token_ids": ids, "finish_reason": "stop"}]},
                "chat_request": CHAT_REQUEST,
                "prompt_token_ids": [1],
            },
        )
        assert batch.status_code == 200, batch.text
        msg = batch.json()["choices"][0]["message"]
        assert msg["content"] == want_content
        assert [
            (c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]
        ] == want

        content, finish = "", None
        calls: dict[Any, Any] = {}
        for out in derender_chat_stream(client, ids, size, CHAT_REQUEST, [1]):
            choice = out["chunk"]["choices"][0]
            content += choice["delta"]["content"] or ""
            for tc in choice["delta"].get("tool_calls") or []:
                call = calls.setdefault(tc["index"], {"id": tc.get("id"), "name": "", "args": ""})
                call["name"] += tc["function"].get("name") or ""
                call["args"] += tc["function"].get("arguments") or ""
            finish = choice["finish_reason"]
    assert [(calls[k]["name"], calls[k]["args"]) for k in sorted(calls)] == want
    assert all(c["id"] for c in calls.values())
    assert finish == "tool_calls"
    assert content.strip() == (want_content or "").strip()
