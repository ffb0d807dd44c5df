"""Tool calls from JSON-constrained output: ``tool_choice`` named or "required".

When render constrained the output with the JSON schema from the tools (see
:mod:`..tool_choice`), vLLM 0.32 reads it back without the tool parser's syntax
(``Parser._extract_tool_calls`` / ``_extract_tool_calls_streaming``):

* named: the whole output is the arguments of that function (batch: no call when the output
  is empty or whitespace); streaming sends each delta as argument text.
* "required": the output is a JSON array of ``{"name", "parameters"}``; batch validates it
  as ``list[FunctionDefinition]`` (any error: no calls); streaming
  (``tool_parsers/streaming.py: extract_required_tool_call_streaming``) announces a call once
  its name is complete and its ``parameters`` value has started, then streams the raw text
  of that value. vLLM rescans the whole text on every chunk; :class:`RequiredToolParser`
  runs the same scanner one character at a time with its state in the stream state, so a
  chunk costs O(its length) plus, at most, the arguments held back before a call's name.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, model_validator

from vllm_pd_ext.render_server.parsers.state import Index, Length, ParserState, Text

# parse states inside one element object of the array (vLLM's names)
_EXPECT_KEY, _EXPECT_COLON, _EXPECT_VALUE = 0, 1, 2
_IN_STRING_VALUE, _IN_CONTAINER_VALUE, _IN_SCALAR_VALUE, _AFTER_VALUE = 3, 4, 5, 6


class NamedState(ParserState):
    """The streaming state of :class:`NamedToolParser`."""

    #: the call's name went out with the first arguments
    sent: bool


class RequiredElement(ParserState):
    """The array element :class:`RequiredToolParser` is reading."""

    #: the element's ``name`` value, once read (None: not read, or not a string)
    name: Text | None
    #: argument text held until the call is announced
    args: Text
    #: where the ``parameters`` value is: not started, being read, or read
    args_state: Literal["none", "open", "closed"]
    #: the call went out (name and the start of its arguments)
    announced: bool


class RequiredState(ParserState):
    """The streaming state of :class:`RequiredToolParser` (its scanner's registers)."""

    #: nesting of ``{}`` and ``[]``; element objects sit at 2
    depth: Length
    in_string: bool
    escaped: bool
    #: the element scanner's state (``_EXPECT_KEY`` ... ``_AFTER_VALUE``)
    expect: Annotated[int, Field(ge=_EXPECT_KEY, le=_AFTER_VALUE)]
    #: the key whose value is being read
    key: Text | None
    #: raw text of the key or name string being read (a name's starts with its quote)
    strbuf: Text | None
    #: the scan stopped (end of the array or not an array)
    done: bool
    #: an element ended without becoming a call: vLLM stops there
    blocked: bool
    #: the array index of the current element (-1: none yet)
    index: Index
    cur: RequiredElement | None

    @model_validator(mode="after")
    def _name_is_a_string(self) -> RequiredState:
        reading_name = self.expect == _IN_STRING_VALUE and self.key == "name"
        if reading_name and self.strbuf is not None and not self.strbuf.startswith('"'):
            # the name is parsed as JSON once it closes: it must be a JSON string
            raise ValueError("strbuf of a name being read starts with its quote")
        return self


def _reject_constant(value: str) -> Any:
    raise ValueError(f"invalid JSON constant {value}")


class NamedToolParser:
    """``tool_choice`` names one function: the output is its arguments."""

    state_model: ClassVar[type[ParserState]] = NamedState

    def __init__(self, name: str) -> None:
        self.name = name

    def extract(self, text: str, content: str | None) -> tuple[list[dict[str, str]], str | None]:
        if content is None or not content.strip():
            return [], None
        return [{"name": self.name, "arguments": content}], None

    @staticmethod
    def initial_state() -> dict[str, Any]:
        return {"sent": False}

    def stream(
        self, state: dict[str, Any], text: str, *, finished: bool
    ) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
        if not text:
            return "", [], state
        function: dict[str, Any] = {"arguments": text}
        if not state.get("sent"):
            function = {"name": self.name, "arguments": text}
        return "", [{"index": 0, "function": function}], {"sent": True}


def _definitions(content: str) -> list[dict[str, Any]] | None:
    """``TypeAdapter(list[FunctionDefinition]).validate_json(content)``, or None on error."""
    try:
        items = json.loads(content, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return None
    if not isinstance(items, list):
        return None
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        if not isinstance(item.get("parameters"), dict | None):
            return None
        if not isinstance(item.get("description"), str | None):
            return None
        for flag in ("strict", "defer_loading"):
            if not isinstance(item.get(flag), bool | None):
                return None
    return items


class RequiredToolParser:
    """``tool_choice`` "required": a JSON array of ``{"name": ..., "parameters": ...}``."""

    state_model: ClassVar[type[ParserState]] = RequiredState

    def extract(self, text: str, content: str | None) -> tuple[list[dict[str, str]], str | None]:
        items = _definitions(content or "")
        if items is None:
            return [], None
        calls = [
            {"name": it["name"], "arguments": json.dumps(it.get("parameters"), ensure_ascii=False)}
            for it in items
        ]
        return calls, None

    @staticmethod
    def initial_state() -> dict[str, Any]:
        return {
            "depth": 0,  # nesting of {} and []; element objects sit at 2
            "in_string": False,
            "escaped": False,
            "expect": _EXPECT_KEY,
            "key": None,  # the key whose value is being read
            "strbuf": None,  # raw text of the key or name string being read
            "done": False,  # the scan stopped (end of the array or not an array)
            "blocked": False,  # an element ended without becoming a call: vLLM stops there
            "index": -1,  # array index of the current element
            "cur": None,  # the current element: name, args, args_state, announced
        }

    def stream(
        self, state: dict[str, Any], text: str, *, finished: bool
    ) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
        s = dict(state)
        cur = dict(s["cur"]) if s["cur"] is not None else None
        out: dict[int, dict[str, Any]] = {}
        if s["done"]:
            return "", [], s
        depth, in_string, escaped = s["depth"], s["in_string"], s["escaped"]
        expect, key, strbuf = s["expect"], s["key"], s["strbuf"]

        def add_args(chunk: str) -> None:
            assert cur is not None
            if cur["announced"]:
                entry = out.setdefault(s["index"], {"index": s["index"], "function": {}})
                fn = entry["function"]
                fn["arguments"] = fn.get("arguments", "") + chunk
            else:
                cur["args"] += chunk

        def maybe_announce() -> None:
            assert cur is not None
            if cur["announced"] or s["blocked"]:
                return
            if cur["name"] is not None and cur["args_state"] != "none":
                cur["announced"] = True
                out[s["index"]] = {
                    "index": s["index"],
                    "function": {"name": cur["name"], "arguments": cur["args"]},
                }
                cur["args"] = ""

        for ch in text:
            in_args = cur is not None and cur["args_state"] == "open" and depth >= 2
            include = in_args
            if in_string:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_string = False
                    if depth == 2 and cur is not None:
                        if expect == _EXPECT_KEY:
                            key = strbuf
                            strbuf = None
                            expect = _EXPECT_COLON
                        elif expect == _IN_STRING_VALUE:
                            if key == "name":
                                try:
                                    name = json.loads((strbuf or "") + '"')
                                    cur["name"] = name if isinstance(name, str) else None
                                except (ValueError, RecursionError):
                                    cur["name"] = None
                                strbuf = None
                            elif key == "parameters":
                                cur["args_state"] = "closed"  # closing quote included
                            expect = _AFTER_VALUE
                if in_string and strbuf is not None:
                    strbuf += ch
                if include:
                    add_args(ch)
                if cur is not None:
                    maybe_announce()
                continue
            if ch == '"':
                in_string = True
                if depth == 2 and cur is not None:
                    if expect == _EXPECT_KEY:
                        strbuf = ""
                    elif expect == _EXPECT_VALUE:
                        expect = _IN_STRING_VALUE
                        if key == "parameters":
                            cur["args_state"] = "open"
                            include = True
                        elif key == "name":
                            strbuf = '"'
                if include:
                    add_args(ch)
                if cur is not None:
                    maybe_announce()
                continue
            if ch in "{[":
                if depth == 0:
                    if ch != "[":
                        s["done"] = True
                        break
                elif depth == 1:
                    if ch != "{":
                        s["done"] = True
                        break
                    if cur is not None and not cur["announced"]:
                        s["blocked"] = True
                    s["index"] += 1
                    cur = {"name": None, "args": "", "args_state": "none", "announced": False}
                    expect, key = _EXPECT_KEY, None
                elif depth == 2 and cur is not None and expect == _EXPECT_VALUE:
                    expect = _IN_CONTAINER_VALUE
                    if key == "parameters":
                        cur["args_state"] = "open"
                        include = True
                depth += 1
                if include:
                    add_args(ch)
                if cur is not None:
                    maybe_announce()
                continue
            if ch in "}]":
                if depth == 2 and cur is not None and expect == _IN_SCALAR_VALUE:
                    if key == "parameters":
                        cur["args_state"] = "closed"  # the terminator is not part of it
                        include = False
                    expect = _AFTER_VALUE
                depth -= 1
                if depth == 2 and cur is not None and expect == _IN_CONTAINER_VALUE:
                    if key == "parameters":
                        cur["args_state"] = "closed"  # closing bracket included
                    expect = _AFTER_VALUE
                if include:
                    add_args(ch)
                if depth == 1:
                    if cur is not None:
                        maybe_announce()
                        if not cur["announced"]:
                            s["blocked"] = True
                    cur = None
                elif depth <= 0:
                    s["done"] = True
                    break
                elif cur is not None:
                    maybe_announce()
                continue
            if depth != 2 or cur is None:
                if include:
                    add_args(ch)
                continue
            if ch == ":":
                if expect == _EXPECT_COLON:
                    expect = _EXPECT_VALUE
            elif ch == ",":
                if expect == _IN_SCALAR_VALUE and key == "parameters":
                    cur["args_state"] = "closed"
                    include = False
                expect, key = _EXPECT_KEY, None
            elif ch.isspace():
                if expect == _IN_SCALAR_VALUE:
                    if key == "parameters":
                        cur["args_state"] = "closed"
                        include = False
                    expect = _AFTER_VALUE
            elif expect == _EXPECT_VALUE:
                expect = _IN_SCALAR_VALUE
                if key == "parameters":
                    cur["args_state"] = "open"
                    include = True
            if include:
                add_args(ch)
            maybe_announce()
        s.update(
            depth=depth,
            in_string=in_string,
            escaped=escaped,
            expect=expect,
            key=key,
            strbuf=strbuf,
            cur=cur,
        )
        return "", [out[i] for i in sorted(out)], s
