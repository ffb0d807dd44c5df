"""Reasoning and tool-call parsers whose streaming state is plain JSON.

A :class:`ChatParser` splits a model output into reasoning, content and tool calls, either in
one go (:meth:`ChatParser.parse`) or chunk by chunk (:meth:`ChatParser.parse_delta`), carrying
its whole state in a small dict the client sends back with the next chunk. No call looks at
text it has already seen except a bounded tail (a partial marker or the tool call being read).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_pd_ext.render_server.parsers.base import ChatParser
from vllm_pd_ext.render_server.parsers.buffered import DeepSeekV3ToolParser, Llama3JsonToolParser
from vllm_pd_ext.render_server.parsers.forced import NamedToolParser, RequiredToolParser
from vllm_pd_ext.render_server.parsers.hermes import HermesToolParser
from vllm_pd_ext.render_server.parsers.mistral import mistral_tool_parser
from vllm_pd_ext.render_server.parsers.reasoning import ThinkReasoningParser
from vllm_pd_ext.render_server.tool_choice import forced_mode, forced_name, is_forced

__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "ChatParser",
    "make_parser",
    "reasoning_active",
    "reasoning_keeps_special_tokens",
    "reasoning_parser",
]

#: Built-in reasoning parsers by vLLM's names (all parse ``<think>``; see ``reasoning_active``).
REASONING_PARSERS = ("deepseek_r1", "qwen3", "deepseek_v3")


def reasoning_active(reasoning: str, template_kwargs: dict[str, Any]) -> bool:
    """Whether ``<think>`` parsing applies: always for deepseek_r1; for qwen3 unless the
    template was told ``enable_thinking: false`` (vLLM's qwen3 then parses no reasoning); for
    deepseek_v3 (DeepSeek-V3.x hybrid thinking) only when the template was asked to think."""
    if reasoning == "deepseek_v3":
        return bool(template_kwargs.get("thinking")) or bool(template_kwargs.get("enable_thinking"))
    if reasoning == "qwen3":
        return template_kwargs.get("enable_thinking", True) is not False
    return reasoning == "deepseek_r1"


def reasoning_keeps_special_tokens(reasoning: str | None) -> bool:
    """Whether the reasoning parser's ``adjust_request`` sets ``skip_special_tokens: false``
    on every chat request (vLLM's qwen3, an engine parser, does; the others leave it)."""
    return reasoning == "qwen3"


def reasoning_parser(tok: Any, reasoning: str) -> ThinkReasoningParser:
    """The ``<think>`` parser for the reasoning parser named ``reasoning``. vLLM's qwen3 finds
    the markers in the text when the tokenizer has no such tokens; the others need the tokens
    (:class:`RenderError` without them, as vLLM's parsers raise)."""
    return ThinkReasoningParser(tok, text_markers=reasoning == "qwen3")


#: Built-in tool-call parsers by vLLM's names: factories taking the tokenizer.
TOOL_PARSERS: dict[str, Callable[[Any], Any]] = {
    "hermes": lambda tok: HermesToolParser(),
    "llama3_json": lambda tok: Llama3JsonToolParser(),
    "deepseek_v3": lambda tok: DeepSeekV3ToolParser(),
    "mistral": mistral_tool_parser,
}


def _tool_choice_parsed(tool_choice: Any, parser: Any) -> bool:
    """Whether the tool parser reads the output for this ``tool_choice``: ``auto`` (or unset);
    ``required`` / named too for parsers that handle them as ``auto`` (vLLM's
    ``supports_required_and_named = False``, e.g. mistral)."""
    if tool_choice in ("auto", None):
        return True
    if tool_choice == "none":
        return False
    handles = getattr(parser, "handles_required_and_named", None)
    if handles is None:  # hermes / llama3_json / deepseek_v3: as auto under strict tool calling
        return forced_mode(getattr(parser, "parser_name", None)) == "auto"
    return bool(handles)


def make_parser(
    tok: Any,
    *,
    reasoning: str | None,
    tools: str | None,
    request: Any,
    enable_auto_tools: bool,
    template_kwargs: dict[str, Any] | None = None,
) -> ChatParser:
    """The combined parser for the server's ``--reasoning-parser`` / ``--tool-call-parser``.

    ``template_kwargs`` are the chat template kwargs the prompt was rendered with; the
    ``deepseek_v3`` reasoning parser reads ``thinking`` / ``enable_thinking`` from them.
    """
    think_parser = None
    if reasoning is not None and reasoning_active(reasoning, template_kwargs or {}):
        think_parser = reasoning_parser(tok, reasoning)
    tool_choice = getattr(request, "tool_choice", None)
    forced = bool(request.tools) and is_forced(tool_choice) and tools in TOOL_PARSERS
    if forced and forced_mode(tools) == "json":
        # the output is JSON constrained by the tools' schema (vLLM's standard parsing)
        name = forced_name(tool_choice)
        json_parser = NamedToolParser(name) if name is not None else RequiredToolParser()
        return ChatParser(think_parser, json_parser, forced=True)
    tool_parser = None
    discard_calls: str | None = None
    if tools in TOOL_PARSERS and enable_auto_tools:
        tool_parser = TOOL_PARSERS[tools](tok)
        tool_parser.parser_name = tools
        if not request.tools or not _tool_choice_parsed(tool_choice, tool_parser):
            # vLLM's parser-engine parsers (mistral v11) still run without tools or with
            # tool_choice "none": the calls are cut from the content and not returned
            if getattr(tool_parser, "parses_without_tools", False):
                discard_calls = "none" if request.tools and tool_choice == "none" else "absent"
            else:
                tool_parser = None
    return ChatParser(
        think_parser,
        tool_parser,
        discard_calls=discard_calls,
        forced=forced and tool_parser is not None,
    )
