"""Hermes / Qwen2.5 tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar

from pydantic import model_validator

from vllm_pd_ext.render_server.parsers.state import Count, ParserState, Text

START = "<tool_call>"
END = "</tool_call>"
_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def _overlap(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _call(raw: str) -> dict[str, str] | None:
    try:
        obj = json.loads(raw)
        return {"name": obj["name"], "arguments": json.dumps(obj["arguments"], ensure_ascii=False)}
    except (ValueError, KeyError, TypeError, RecursionError):
        return None


class HermesState(ParserState):
    """The streaming state of :class:`HermesToolParser`."""

    #: the call being read (``in_call``), else a partial ``<tool_call>`` held back
    buf: Text
    in_call: bool
    #: the next call's index: the calls emitted so far
    index: Count
    #: a call was read: later text is not content
    called: bool

    @model_validator(mode="after")
    def _partial_tag_outside_calls(self) -> HermesState:
        if not self.in_call and len(self.buf) >= len(START):
            raise ValueError(f"buf outside a call holds at most {len(START) - 1} characters")
        return self


class HermesToolParser:
    """Batch extraction as vLLM's ``hermes`` parser; streaming emits each call when it closes.

    Streaming state: :class:`HermesState`. ``buf`` holds at most a partial tag or the call
    being read.
    """

    state_model: ClassVar[type[ParserState]] = HermesState

    def extract(self, text: str, content: str | None) -> tuple[list[dict[str, str]], str | None]:
        """``(tool_calls, content)`` of a complete output (content: text before the first call)."""
        if START not in text:
            return [], content
        try:
            calls = []
            for closed, open_ended in _CALL_RE.findall(text):
                obj = json.loads(closed if closed else open_ended)
                calls.append(
                    {
                        "name": obj["name"],
                        "arguments": json.dumps(obj["arguments"], ensure_ascii=False),
                    }
                )
        except (ValueError, KeyError, TypeError, RecursionError):
            return [], content
        before = text[: text.find(START)]
        if before.strip() == "":
            before = ""
        return calls, before or None

    @staticmethod
    def initial_state() -> dict[str, Any]:
        return {"buf": "", "in_call": False, "index": 0, "called": False}

    def stream(
        self, state: dict[str, Any], text: str, *, finished: bool
    ) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
        """``(content, tool_call_deltas, next_state)`` for one chunk of post-reasoning text."""
        buf = str(state.get("buf", "")) + text
        in_call = bool(state.get("in_call"))
        index = int(state.get("index", 0))
        called = bool(state.get("called"))
        content_parts: list[str] = []
        calls: list[dict[str, Any]] = []
        while True:
            if in_call:
                # only the new tail can complete END: search from where it could start
                start_at = max(0, len(buf) - len(text) - len(END))
                pos = buf.find(END, start_at)
                if pos < 0:
                    break
                call = _call(buf[:pos])
                if call is None and not called:
                    # not a call after all: batch parsing returns such text as content
                    content_parts.append(START + buf[: pos + len(END)])
                    buf = buf[pos + len(END) :]
                    text = buf
                    in_call = False
                    continue
                if call is not None:
                    calls.append(
                        {
                            "index": index,
                            "function": {"name": call["name"], "arguments": call["arguments"]},
                        }
                    )
                    index += 1
                buf = buf[pos + len(END) :]
                text = buf
                in_call = False
                called = True
                continue
            pos = buf.find(START)
            if pos >= 0:
                if not called:
                    content_parts.append(buf[:pos])
                buf = buf[pos + len(START) :]
                text = buf
                in_call = True
                continue
            keep = _overlap(buf, START)
            if not called:
                content_parts.append(buf[: len(buf) - keep])
            buf = buf[len(buf) - keep :]
            break
        if finished:
            if in_call:
                call = _call(buf)
                if call is not None:
                    calls.append(
                        {
                            "index": index,
                            "function": {"name": call["name"], "arguments": call["arguments"]},
                        }
                    )
                    index += 1
                    called = True
            elif not called:
                content_parts.append(buf)
            buf = ""
        content = "".join(content_parts)
        new_state = {"buf": buf, "in_call": in_call, "index": index, "called": called}
        return content, calls, new_state
