"""vLLM's own tool-call patterns, the oracles our one-pass scanners are checked against
(tests/unit/render_server/test_linear_parsers.py) and timed beside
(benchmarks/parser_scaling.py). Needs vLLM."""

from __future__ import annotations

import re
from pathlib import Path

from vllm_pd_ext.render_server.parsers.buffered import (
    DS_CALL_BEGIN,
    DS_CALL_END,
    DS_CALLS_BEGIN,
    DS_SEP,
    _ds,
)

#: The pre-v11 Mistral array pattern, as vllm/parser/mistral.py compiles it (with DOTALL).
MISTRAL_ARRAY_SOURCE = r"\[{.*}\]"


def deepseek_v3_pattern() -> re.Pattern[str]:
    """vLLM's compiled ``deepseek_v3`` call pattern, from its parser, built over a vocabulary
    that holds the DeepSeek markers (all its constructor reads of a tokenizer)."""
    from vllm.tool_parsers.deepseekv3_tool_parser import DeepSeekV3ToolParser

    markers = [DS_CALLS_BEGIN, _ds("tool calls end"), DS_CALL_BEGIN, DS_CALL_END, DS_SEP]

    class Vocab:
        def get_vocab(self) -> dict[str, int]:
            return {t: i for i, t in enumerate(markers)}

    return DeepSeekV3ToolParser(Vocab()).tool_call_regex


def mistral_array_pattern() -> re.Pattern[str]:
    """vLLM's pre-v11 Mistral array pattern; raises ``LookupError`` when vLLM's source no
    longer compiles it as written here."""
    import vllm.parser.mistral as mistral

    if (
        f're.compile(r"{MISTRAL_ARRAY_SOURCE}", re.DOTALL)'
        not in Path(mistral.__file__).read_text()
    ):
        raise LookupError("vllm/parser/mistral.py no longer compiles the array pattern we know")
    return re.compile(MISTRAL_ARRAY_SOURCE, re.DOTALL)
