"""Mistral tool calls, as vLLM's ``mistral`` tool parser reads them.

Two formats, chosen by the tokenizer the way vLLM chooses (``[ARGS]`` in the vocabulary):

* v11+ (Mistral Small 3.x, Devstral, Magistral, ...): ``[TOOL_CALLS]name[ARGS]{...}``, or
  ``[TOOL_CALLS]name{...}``, repeated for parallel calls. Nothing closes a call: the next
  ``[TOOL_CALLS]`` or the end of the output does. The arguments are the first JSON value
  after the separator (trailing text dropped; text that is not JSON is kept, stripped).
* pre-v11 (Mistral 7B v0.3, Mixtral): ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``.

Streaming: content before the first ``[TOOL_CALLS]`` streams as it arrives (a partial marker is
held back; leading whitespace-only content waits and is dropped if a call follows, as vLLM
does). Each call is emitted complete once it has ended -- at the next ``[TOOL_CALLS]`` or with
the final chunk -- with exactly the name and arguments batch parsing gives. The stream state
holds only the call being read, so each chunk costs O(new text) plus, once per call, the
call's own length.

vLLM 0.32 runs the v11 format through its parser engine, which drops the text of the
tokenizer's special tokens (``all_special_tokens``: bos, eos, pad...) wherever it appears --
content, names, arguments -- in one left-to-right pass; the v11 parser here does the same (a
partial special-token text at a chunk's end is held back until the next chunk). The pre-v11
path keeps them, as vLLM's does.

Not mirrored: vLLM's v11 batch path coerces string argument values to the types the tool's
JSON schema declares (its streaming path does not); pre-v11 ``required`` / named tool choice
(vLLM adds a guided-JSON schema to the sampling params and parses a bare JSON array).
"""

from __future__ import annotations

import json
import re
import secrets
import string
from typing import Any, ClassVar, Literal

from vllm_pd_ext.render_server.errors import RenderError
from vllm_pd_ext.render_server.parsers.buffered import BufferedToolParser
from vllm_pd_ext.render_server.parsers.hermes import _overlap
from vllm_pd_ext.render_server.parsers.state import Count, ParserState, Text, TokenText

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_ALNUM = string.ascii_letters + string.digits
_DECODER = json.JSONDecoder()


def first_array(body: str) -> str | None:
    """The first match of vLLM's ``\\[{.*}\\]`` (dot matching line breaks) in ``body``, found
    without backtracking (which is quadratic in the length): from the first ``[{`` to the
    last ``}]`` after it."""
    start = body.find("[{")
    if start < 0:
        return None
    end = body.rfind("}]", start + 2)
    return body[start : end + 2] if end >= 0 else None


def mistral_tool_call_id() -> str:
    """A Mistral tool-call id: 9 random alphanumerics (what mistral-common accepts)."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


def _first_json(raw: str) -> str:
    """The first complete JSON value of ``raw`` (stripped); ``raw`` stripped if none parses."""
    stripped = raw.strip()
    if not stripped:
        return "{}"
    try:
        _, end = _DECODER.raw_decode(stripped)
    except (ValueError, RecursionError):
        return stripped
    return stripped[:end]


def _call(name_raw: str, args_raw: str) -> dict[str, str] | None:
    """The call of one ``[TOOL_CALLS]`` section, or None for an empty section."""
    if not name_raw and not args_raw:
        return None
    return {"name": name_raw.strip(), "arguments": _first_json(args_raw)}


def _name_end(text: str, start: int = 0) -> tuple[int, int, str]:
    """``(end_of_name, start_of_args, args_prefix)`` in ``text``, or ``(-1, -1, "")``.

    The name ends at the first ``[ARGS]`` (dropped) or ``{`` (kept: it opens the arguments).
    """
    a = text.find(ARGS, start)
    b = text.find("{", start)
    if a >= 0 and (b < 0 or a < b):
        return a, a + len(ARGS), ""
    if b >= 0:
        return b, b + 1, "{"
    return -1, -1, ""


def _sections(text: str) -> list[tuple[str, str]]:
    """``(name, arguments)`` raw text of every ``[TOOL_CALLS]`` section after the first marker.

    A ``[TOOL_CALLS]`` inside a name is part of the name (vLLM's grammar has no transition for
    it there); ``[ARGS]`` inside arguments is part of the arguments.
    """
    out = []
    rest = text
    while True:
        end, args_at, prefix = _name_end(rest)
        if end < 0:
            out.append((rest, ""))
            return out
        name, rest = rest[:end], rest[args_at:]
        nxt = rest.find(TOOL_CALLS)
        if nxt < 0:
            out.append((name, prefix + rest))
            return out
        out.append((name, prefix + rest[:nxt]))
        rest = rest[nxt + len(TOOL_CALLS) :]


class MistralState(ParserState):
    """The streaming state of :class:`MistralToolParser`."""

    #: what the next text is: content before the calls, a call's name, or its arguments
    mode: Literal["content", "name", "args"]
    #: content held back: a partial ``[TOOL_CALLS]``, or whitespace that may precede a call
    held: Text
    #: the content so far had non-whitespace
    nonws: bool
    #: the name and argument text of the call being read
    name: Text
    args: Text
    #: the next call's index: the calls emitted so far
    index: Count
    #: a partial special-token text held back at the chunk's end (absent when empty)
    drop_held: TokenText = ""


class MistralToolParser:
    """v11+ ``[TOOL_CALLS]name[ARGS]{...}`` calls; batch and streaming agree on the calls.

    Streaming state: :class:`MistralState`.
    """

    state_model: ClassVar[type[ParserState]] = MistralState
    handles_required_and_named = True
    #: vLLM runs it (dropping special-token text, cutting calls) even without tools
    parses_without_tools = True
    make_tool_call_id = staticmethod(mistral_tool_call_id)

    def __init__(self, drop: tuple[str, ...] = ()) -> None:
        #: special-token texts removed from the output before parsing (see the module doc)
        self.drop = tuple(sorted(set(drop), key=len, reverse=True))
        self._drop_re = re.compile("|".join(map(re.escape, self.drop))) if self.drop else None

    def _dropped(self, text: str) -> str:
        return self._drop_re.sub("", text) if self._drop_re is not None else text

    def content_before_calls(self, text: str) -> str | None:
        """The content vLLM's batch parse gives with tool_choice "none": the text before the
        first ``[TOOL_CALLS]`` (special-token text dropped), not stripped."""
        return self._dropped(text).partition(TOOL_CALLS)[0] or None

    def extract(self, text: str, content: str | None) -> tuple[list[dict[str, str]], str | None]:
        """``(tool_calls, content)`` of a complete output (content: text before the calls)."""
        text = self._dropped(text)
        pos = text.find(TOOL_CALLS)
        if pos < 0:
            return [], text or None
        before = text[:pos]
        calls = [c for c in (_call(n, a) for n, a in _sections(text[pos + len(TOOL_CALLS) :])) if c]
        if calls or not before.strip():
            return calls, before.strip() or None
        return calls, before

    @staticmethod
    def initial_state() -> dict[str, Any]:
        return {"mode": "content", "held": "", "nonws": False, "name": "", "args": "", "index": 0}

    def stream(
        self, state: dict[str, Any], text: str, *, finished: bool
    ) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
        """``(content, tool_call_deltas, next_state)`` for one chunk of post-reasoning text."""
        drop_held = ""
        if self._drop_re is not None:
            buf = self._dropped(str(state.get("drop_held", "")) + text)
            keep = 0 if finished else max(_overlap(buf, d) for d in self.drop)
            text, drop_held = buf[: len(buf) - keep], buf[len(buf) - keep :]
        mode = str(state.get("mode", "content"))
        held = str(state.get("held", ""))
        nonws = bool(state.get("nonws"))
        name = str(state.get("name", ""))
        args = str(state.get("args", ""))
        index = int(state.get("index", 0))
        content = ""
        calls: list[dict[str, Any]] = []

        def emit(name_raw: str, args_raw: str) -> None:
            nonlocal index
            call = _call(name_raw, args_raw)
            if call is not None:
                calls.append({"index": index, "function": call})
                index += 1

        if mode == "content":
            buf = held + text
            pos = buf.find(TOOL_CALLS)
            if pos >= 0:
                before = buf[:pos]
                if nonws or before.strip():
                    content, nonws = before, True
                held, mode, name, text = "", "name", "", buf[pos + len(TOOL_CALLS) :]
            else:
                keep = _overlap(buf, TOOL_CALLS)
                ready = buf[: len(buf) - keep]
                if nonws or ready.strip():
                    content, held, nonws = ready, buf[len(buf) - keep :], True
                else:
                    held = buf  # whitespace only so far: wait for more
                text = ""
        while mode != "content":
            if mode == "name":
                start = max(0, len(name) - len(ARGS) + 1)
                name += text
                end, args_at, prefix = _name_end(name, start)
                if end < 0:
                    break
                name, text = name[:end], name[args_at:]
                mode, args = "args", prefix
            start = max(0, len(args) - len(TOOL_CALLS) + 1)
            args += text
            nxt = args.find(TOOL_CALLS, start)
            if nxt < 0:
                break
            emit(name, args[:nxt])
            text, name, args, mode = args[nxt + len(TOOL_CALLS) :], "", "", "name"
        if finished:
            if mode == "content":
                content += held
                held = ""
            else:
                emit(name, args)
                name = args = ""
        new_state = {
            "mode": mode,
            "held": held,
            "nonws": nonws,
            "name": name,
            "args": args,
            "index": index,
        }
        if drop_held:
            new_state["drop_held"] = drop_held
        return content, calls, new_state


def _legacy_calls(parsed: Any) -> list[dict[str, str]]:
    """Calls in the JSON after a pre-v11 marker: a bare object is one call; entries that are
    not call objects are skipped; a missing name is ``""``; string arguments are kept."""
    if isinstance(parsed, dict):
        parsed = [parsed]
    if not isinstance(parsed, list):
        return []
    calls = []
    for item in parsed:
        if not isinstance(item, dict) or not ("name" in item or "arguments" in item):
            continue
        name = item.get("name")
        arguments = item.get("arguments")
        if arguments is None:
            arguments = "{}"
        elif not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append({"name": name if isinstance(name, str) else "", "arguments": arguments})
    return calls


class MistralLegacyToolParser(BufferedToolParser):
    """pre-v11 ``[TOOL_CALLS][{...}, ...]``: content streams, the calls come with the end."""

    markers = (TOOL_CALLS,)
    #: vLLM reads required / named output like auto (``supports_required_and_named = False``)
    handles_required_and_named = True
    make_tool_call_id = staticmethod(mistral_tool_call_id)

    def extract(self, text: str, content: str | None) -> tuple[list[dict[str, str]], str | None]:
        if TOOL_CALLS not in text:
            return [], content or None
        before, *segments = text.split(TOOL_CALLS)
        body = next((s.strip() for s in segments if s.strip()), "")
        try:
            parsed, _ = _DECODER.raw_decode(body)
        except (ValueError, RecursionError):
            array = first_array(body)
            try:
                parsed = json.loads(array) if array is not None else None
            except (ValueError, RecursionError):
                parsed = None
        calls = _legacy_calls(parsed)
        if not calls:
            return [], body or None
        return calls, before if before.strip() else None


def mistral_tool_parser(tok: Any) -> MistralToolParser | MistralLegacyToolParser:
    """The parser for ``tok``'s format (v11+ when ``[ARGS]`` is a token), as vLLM picks it.

    Raises :class:`RenderError` when ``[TOOL_CALLS]`` is not a token (vLLM refuses too).
    """
    if tok.token_id(TOOL_CALLS) is None:
        raise RenderError(
            "Mistral parser could not locate the tool call token in the tokenizer!",
            status=500,
            err_type="InternalServerError",
        )
    if tok.token_id(ARGS) is None:
        return MistralLegacyToolParser()
    keep = (TOOL_CALLS, ARGS, "{", "[THINK]", "[/THINK]")  # vLLM's grammar terminals
    return MistralToolParser(tuple(t for t in tok.hf.all_special_tokens if t not in keep))
