"""Tool parsers that stream content until a start marker, then hold the call text to the end.

Batch extraction follows vLLM's ``llama3_json`` and ``deepseek_v3`` parsers exactly. When
streaming, text before the tool-call marker is content (a partial marker is held back); from
the marker on, the text is kept in the stream state and the calls are emitted, complete, with
the final chunk. Each call does O(new text) work; the state holds only the tool-call text.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from pydantic import model_validator

from vllm_pd_ext.render_server.parsers.hermes import _overlap
from vllm_pd_ext.render_server.parsers.state import ParserState, Text


class BufferedState(ParserState):
    """The streaming state of a :class:`BufferedToolParser` (see :func:`buffered_state`)."""

    #: the tool-call section (``in_calls``), else a partial marker held back
    buf: Text
    in_calls: bool
    #: the content so far had non-whitespace (llama3_json: a later ``{`` is content)
    seen: bool


@functools.cache
def buffered_state(markers: tuple[str, ...]) -> type[ParserState]:
    """:class:`BufferedState` for a parser whose calls start at one of ``markers``: outside
    the calls ``buf`` holds at most a partial marker."""
    held = max(map(len, markers)) - 1

    class MarkerState(BufferedState):
        @model_validator(mode="after")
        def _partial_marker_outside_calls(self) -> MarkerState:
            if not self.in_calls and len(self.buf) > held:
                raise ValueError(f"buf outside the calls holds at most {held} characters")
            return self

    return MarkerState


class BufferedToolParser:
    """Base: ``markers`` start the tool-call section; subclasses implement :meth:`extract`."""

    markers: tuple[str, ...] = ()

    @property
    def state_model(self) -> type[ParserState]:
        """The shape of this parser's streaming state."""
        return buffered_state(self.markers)

    def extract(self, text: str, content: str | None) -> tuple[list[dict[str, str]], str | None]:
        raise NotImplementedError

    @staticmethod
    def initial_state() -> dict[str, Any]:
        return {"buf": "", "in_calls": False, "seen": False}

    def _starts_calls(self, seen: bool, buf: str) -> int:
        """Index where the tool-call section starts in ``buf``, or -1."""
        found = [buf.find(m) for m in self.markers if m in buf]
        return min(found) if found else -1

    def stream(
        self, state: dict[str, Any], text: str, *, finished: bool
    ) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
        buf = str(state.get("buf", "")) + text
        in_calls = bool(state.get("in_calls"))
        seen = bool(state.get("seen"))
        content = ""
        if not in_calls:
            pos = self._starts_calls(seen, buf)
            if pos >= 0:
                content, buf, in_calls = buf[:pos], buf[pos:], True
            else:
                keep = max((_overlap(buf, m) for m in self.markers), default=0)
                content, buf = buf[: len(buf) - keep], buf[len(buf) - keep :]
            seen = seen or bool(content.strip())
        calls: list[dict[str, Any]] = []
        if finished:
            if in_calls:
                found, rest = self.extract(buf, buf)
                calls = [
                    {"index": i, "function": {"name": c["name"], "arguments": c["arguments"]}}
                    for i, c in enumerate(found)
                ]
                if not found and rest:
                    content += rest
            else:
                content += buf
            buf = ""
        return content, calls, {"buf": buf, "in_calls": in_calls, "seen": seen}


class Llama3JsonToolParser(BufferedToolParser):
    """vLLM's ``llama3_json``: JSON objects (``name`` + ``arguments``/``parameters``)."""

    markers = ("<|python_tag|>", "{")
    _decoder = json.JSONDecoder()

    def _starts_calls(self, seen: bool, buf: str) -> int:
        # a call section starts the output (after optional whitespace / the python tag)
        if seen:
            return -1
        stripped = buf.lstrip()
        if stripped.startswith(("{", "<|python_tag|>")):
            return len(buf) - len(stripped)
        return -1

    def extract(self, text: str, content: str | None) -> tuple[list[dict[str, str]], str | None]:
        if not ("<|python_tag|>" in text or "{" in text):
            return [], content
        end = -1
        calls = []
        for match in re.finditer(r"\{", text):
            start = match.start()
            if start <= end:
                continue
            try:
                obj, end = self._decoder.raw_decode(text, start)  # no copy of the rest
                args = obj["arguments"] if "arguments" in obj else obj["parameters"]
                calls.append(
                    {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}
                )
            except (ValueError, KeyError, TypeError, RecursionError):
                return [], content
        if calls:
            return calls, None
        return [], content


def _ds(name: str) -> str:
    """A DeepSeek special token: ``<`` FULLWIDTH BAR name-with-LOWER-ONE-EIGHTH-BLOCKs BAR ``>``."""
    return "<\uff5c" + name.replace(" ", "\u2581") + "\uff5c>"


DS_CALLS_BEGIN = _ds("tool calls begin")
DS_CALL_BEGIN = _ds("tool call begin")
DS_CALL_END = _ds("tool call end")
DS_SEP = _ds("tool sep")


_JSON_FENCE = "```json\n"
_CALL_CLOSE = "```" + DS_CALL_END


def deepseek_v3_calls(text: str) -> list[tuple[str, str]]:
    """``(name, arguments)`` of each call in ``text``, exactly the matches of vLLM's
    ``deepseek_v3`` pattern ``BEGIN(?P<type>.*)SEP(?P<name>.*)\\n```json\\n(?P<args>.*)\\n```END``
    (``.`` stops at a line break), found in one pass instead of by backtracking, which costs
    the cube of the length on model output full of markers.

    What the pattern matches, read off its shape: a call starts at the first BEGIN on a line
    that has a SEP after it; the name is the rest of the line after the line's last SEP (the
    type is greedy); the next line is exactly ```json; the arguments are the whole line after
    it; the line after that starts with ```END. A line whose first BEGIN fails cannot match
    from a later BEGIN either (that one has fewer SEPs after it), so the search goes on at the
    next line; after a match, right after its END.
    """
    calls: list[tuple[str, str]] = []
    pos = 0
    while (begin := text.find(DS_CALL_BEGIN, pos)) >= 0:
        eol = text.find("\n", begin)
        if eol < 0:
            break
        sep = text.rfind(DS_SEP, begin + len(DS_CALL_BEGIN), eol)
        if sep >= 0 and text.startswith(_JSON_FENCE, eol + 1):
            args = eol + 1 + len(_JSON_FENCE)
            args_end = text.find("\n", args)
            if args_end >= 0 and text.startswith(_CALL_CLOSE, args_end + 1):
                calls.append((text[sep + len(DS_SEP) : eol], text[args:args_end]))
                pos = args_end + 1 + len(_CALL_CLOSE)
                continue
        pos = eol + 1
    return calls


class DeepSeekV3ToolParser(BufferedToolParser):
    """vLLM's ``deepseek_v3``: typed calls with a fenced json block, between DeepSeek markers."""

    markers = (DS_CALLS_BEGIN,)

    def extract(self, text: str, content: str | None) -> tuple[list[dict[str, str]], str | None]:
        if DS_CALLS_BEGIN not in text:
            return [], content
        calls = [{"name": name, "arguments": args} for name, args in deepseek_v3_calls(text)]
        before = text[: text.find(DS_CALLS_BEGIN)]
        return calls, before or None
