"""Tool-call scanners that replace vLLM's backtracking patterns: the same matches as vLLM's
own patterns on random model output full of markers, found in one pass (their cost on long
inputs is measured in benchmarks/parser_scaling.py, not timed here)."""

from __future__ import annotations

import random

from tests.conftest import requires_vllm
from vllm_pd_ext.render_server.parsers.buffered import (
    DS_CALL_BEGIN,
    DS_CALL_END,
    DS_SEP,
    deepseek_v3_calls,
)
from vllm_pd_ext.render_server.parsers.mistral import first_array
from vllm_pd_ext.testing.vllm_patterns import deepseek_v3_pattern, mistral_array_pattern

pytestmark = requires_vllm


def _random_text(rng: random.Random, pieces: list[str], n: int) -> str:
    return "".join(rng.choice(pieces) for _ in range(n))


def test_deepseek_v3_calls_are_vllms_matches():
    pattern = deepseek_v3_pattern()
    pieces = [DS_CALL_BEGIN, DS_SEP, DS_CALL_END, "```json", "```", "\n", "\n", "a", "{}", " "]
    rng = random.Random(7)
    matched = 0
    for _ in range(20000):
        text = _random_text(rng, pieces, rng.randint(0, 24))
        want = [
            (m.group("function_name"), m.group("function_arguments"))
            for m in pattern.finditer(text)
        ]
        assert deepseek_v3_calls(text) == want, repr(text)
        matched += bool(want)
    # well-formed calls, several per text, among noise
    call = DS_CALL_BEGIN + "function" + DS_SEP + "get{}\n```json\n{{}}\n```" + DS_CALL_END
    for _ in range(2000):
        parts = [call.format(rng.randint(0, 9)) for _ in range(rng.randint(1, 3))]
        text = _random_text(rng, pieces, 4).join(parts)
        want = [
            (m.group("function_name"), m.group("function_arguments"))
            for m in pattern.finditer(text)
        ]
        assert deepseek_v3_calls(text) == want, repr(text)
        matched += bool(want)
    assert matched > 1000  # the inputs exercised matches, not only misses


def test_first_array_is_vllms_first_match():
    pattern = mistral_array_pattern()
    pieces = ["[{", "}]", "[", "{", "}", "]", "\n", "a", '"x"', ","]
    rng = random.Random(11)
    for _ in range(20000):
        text = _random_text(rng, pieces, rng.randint(0, 16))
        found = pattern.findall(text)
        assert first_array(text) == (found[0] if found else None), repr(text)
