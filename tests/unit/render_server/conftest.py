"""Fixtures for the render server tests: tiny-qwen with ``<think>`` / ``</think>`` added."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_pd_ext.util.tiny_model import add_think_tokens, add_tokens


@pytest.fixture(scope="session")
def tiny_qwen_think(tiny_qwen, tmp_path_factory) -> Path:
    return add_think_tokens(Path(tiny_qwen), tmp_path_factory.mktemp("tiny-qwen-think"))


@pytest.fixture(scope="session")
def tiny_mistral(tiny_llama, tmp_path_factory) -> Path:
    """tiny-llama with Mistral v11+ control tokens ``[TOOL_CALLS]`` and ``[ARGS]``."""
    dst = tmp_path_factory.mktemp("tiny-mistral")
    return add_tokens(Path(tiny_llama), dst, ("[TOOL_CALLS]", "[ARGS]"), special=True)


@pytest.fixture(scope="session")
def tiny_mistral_v3(tiny_llama, tmp_path_factory) -> Path:
    """tiny-llama with only ``[TOOL_CALLS]`` (a pre-v11 Mistral tokenizer)."""
    dst = tmp_path_factory.mktemp("tiny-mistral-v3")
    return add_tokens(Path(tiny_llama), dst, ("[TOOL_CALLS]",), special=True)
