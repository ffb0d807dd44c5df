"""The combined parser: reasoning first, then tool calls on what follows the reasoning."""

from __future__ import annotations

import functools
import uuid
from typing import Any

from pydantic import create_model

from vllm_pd_ext.render_server.parsers.reasoning import ThinkReasoningParser, ThinkState
from vllm_pd_ext.render_server.parsers.state import ParserState, StateLimits, check_state


@functools.cache
def chat_state(reasoning: bool, tools: type[ParserState] | None) -> type[ParserState]:
    """The shape of :class:`ChatParser`'s streaming state: the reasoning keys
    (:class:`ThinkState`) with a reasoning parser, and ``tools``, the tool parser's own
    state, with a tool parser."""
    base = ThinkState if reasoning else ParserState
    if tools is None:
        return base
    return create_model("ChatState", __base__=base, tools=(tools, ...))


class ChatParser:
    """Reasoning parser and tool parser (either may be absent), batch and streaming."""

    def __init__(
        self,
        reasoning: ThinkReasoningParser | None,
        tools: Any,
        *,
        discard_calls: str | None = None,
        forced: bool = False,
    ) -> None:
        self.reasoning = reasoning
        self.tools = tools
        #: tool_choice "required" / named: an output without calls that is empty or
        #: whitespace gives no content (vLLM's ``_extract_tool_calls``)
        self.forced = forced
        #: parse tool calls out of the content but return none (see ``make_parser``):
        #: "absent" (no tools: content as with calls), "none" (tool_choice none: the content
        #: before the calls unstripped, as vLLM's batch parse gives it)
        self.discard_calls = discard_calls

    def new_tool_call_id(self) -> str:
        """A fresh id for a streamed tool call, in the tool parser's format (vLLM's
        ``chatcmpl-tool-<hex>`` unless the parser has its own, e.g. mistral's 9 alphanumerics)."""
        make = getattr(self.tools, "make_tool_call_id", None)
        return make() if make is not None else f"chatcmpl-tool-{uuid.uuid4().hex[:16]}"

    def set_prompt_token_ids(self, prompt_token_ids: list[int] | None) -> None:
        """Nothing to do: the built-in parsers read the prompt in :meth:`initial_state`."""

    def parse(
        self, text: str, token_ids: list[int], prompt_token_ids: list[int] | None
    ) -> tuple[str | None, str | None, list[dict[str, str]]]:
        """``(reasoning, content, tool_calls)`` of a complete output, as vLLM's ``parse``."""
        reasoning: str | None = None
        content: str | None = text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.extract(text)
        calls: list[dict[str, str]] = []
        if self.tools is not None:
            if self.discard_calls == "none":
                content = self.tools.content_before_calls(content or "")
            else:
                calls, content = self.tools.extract(content or "", content)
            if self.discard_calls:
                calls = []
            if self.forced and not calls and (content is None or not content.strip()):
                content = None
        return reasoning, content, calls

    @property
    def state_model(self) -> type[ParserState]:
        """The shape of this parser's streaming state (it depends on the parsers configured
        and on the request: reasoning may be off, ``tool_choice`` picks the tool parser)."""
        tools = self.tools.state_model if self.tools is not None else None
        return chat_state(self.reasoning is not None, tools)

    def check_state(self, state: Any, limits: StateLimits) -> None:
        """Check a carried streaming state against :attr:`state_model` within ``limits``
        (derender runs it before :meth:`parse_delta`; raises ``pydantic.ValidationError``)."""
        check_state(self.state_model, state, limits)

    def initial_state(self, prompt_token_ids: list[int]) -> dict[str, Any]:
        """The streaming state before the first output token."""
        state: dict[str, Any] = {}
        if self.reasoning is not None:
            state["reasoning_ended"] = self.reasoning.prompt_ended_reasoning(prompt_token_ids)
        if self.tools is not None:
            state["tools"] = self.tools.initial_state()
        return state

    def parse_delta(
        self, state: dict[str, Any], text: str, token_ids: list[int], *, finished: bool
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The delta message for one chunk and the next state; O(len(text)) work."""
        state = dict(state)
        reasoning = None
        content: str | None = text
        if self.reasoning is not None and not state.get("reasoning_ended", True):
            seen_start = bool(state.get("seen_start"))
            if self.reasoning.by_text:
                pending = str(state.get("pending") or "")
                reasoning, content, ended, seen, pending = self.reasoning.split_text_delta(
                    text, pending, seen_start, finished=finished
                )
                state["pending"] = pending
            else:
                reasoning, content, ended, seen = self.reasoning.split_delta(
                    text, token_ids, seen_start
                )
            state["reasoning_ended"] = ended
            state["seen_start"] = seen
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning"] = reasoning
        if self.tools is not None and "tools" in state:
            tool_state = state["tools"]
            if content or finished:
                out_content, calls, tool_state = self.tools.stream(
                    tool_state, content or "", finished=finished
                )
                state["tools"] = tool_state
                if out_content:
                    delta["content"] = out_content
                if calls and not self.discard_calls:
                    delta["tool_calls"] = calls
        elif content:
            delta["content"] = content
        return delta, state
