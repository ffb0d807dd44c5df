"""Reasoning and tool-call parsers whose streaming state is plain JSON.

A :class:`ChatParser` splits a model output into reasoning, content and tool calls, either in
one go (:meth:`ChatParser.parse`) or chunk by chunk (:meth:`ChatParser.parse_delta`), carrying
its whole state in a small dict the client sends back with the next chunk. No call looks at
text it has already seen except a bounded tail (a partial marker or the tool call being read).
"""

from __future__ import annotations

from typing import Any

from vllm_pd_ext.render_server.parsers.base import ChatParser
from vllm_pd_ext.render_server.parsers.buffered import DeepSeekV3ToolParser, Llama3JsonToolParser
from vllm_pd_ext.render_server.parsers.hermes import HermesToolParser
from vllm_pd_ext.render_server.parsers.reasoning import ThinkReasoningParser

__all__ = ["TOOL_PARSERS", "ChatParser", "make_parser"]

#: Built-in tool-call parsers by vLLM's names.
TOOL_PARSERS: dict[str, Any] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "deepseek_v3": DeepSeekV3ToolParser,
}


def make_parser(
    tok: Any,
    *,
    reasoning: str | None,
    tools: str | None,
    request: Any,
    enable_auto_tools: bool,
) -> ChatParser:
    """The combined parser for the server's ``--reasoning-parser`` / ``--tool-call-parser``."""
    reasoning_parser = ThinkReasoningParser(tok) if reasoning in ("deepseek_r1", "qwen3") else None
    tool_parser = None
    tool_choice = getattr(request, "tool_choice", None)
    if (
        tools in TOOL_PARSERS
        and request.tools
        and enable_auto_tools
        and tool_choice
        in (
            "auto",
            None,
        )
    ):
        tool_parser = TOOL_PARSERS[tools]()
    return ChatParser(reasoning_parser, tool_parser)
