"""Tool parsers that stream content until a start marker, then hold the call text to the end.

Batch extraction follows vLLM's ``llama3_json`` and ``deepseek_v3`` parsers exactly. When
streaming, text before the tool-call marker is content (a partial marker is held back); from
the marker on, the text is kept in the stream state and the calls are emitted, complete, with
the final chunk. Each call does O(new text) work; the state holds only the tool-call text.
"""

from __future__ import annotations

import json
import re
from typing import Any

from vllm_pd_ext.render_server.parsers.hermes import _overlap


class BufferedToolParser:
    """Base: ``markers`` start the tool-call section; subclasses implement :meth:`extract`."""

    markers: tuple[str, ...] = ()

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
                obj, length = self._decoder.raw_decode(text[start:])
                end = start + length
                args = obj["arguments"] if "arguments" in obj else obj["parameters"]
                calls.append(
                    {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}
                )
            except (ValueError, KeyError, TypeError):
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


class DeepSeekV3ToolParser(BufferedToolParser):
    """vLLM's ``deepseek_v3``: typed calls with a fenced json block, between DeepSeek markers."""

    markers = (DS_CALLS_BEGIN,)
    _call = re.compile(
        re.escape(DS_CALL_BEGIN)
        + r"(?P<type>.*)"
        + re.escape(DS_SEP)
        + r"(?P<name>.*)\n```json\n(?P<args>.*)\n```"
        + re.escape(DS_CALL_END)
    )

    def extract(self, text: str, content: str | None) -> tuple[list[dict[str, str]], str | None]:
        if DS_CALLS_BEGIN not in text:
            return [], content
        calls = [
            {"name": m.group("name"), "arguments": m.group("args")}
            for m in self._call.finditer(text)
        ]
        before = text[: text.find(DS_CALLS_BEGIN)]
        return calls, before or None
