"""Fixtures for the render server tests: tiny-qwen with ``<think>`` / ``</think>`` added."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


def add_think_tokens(src: Path, dst: Path) -> Path:
    """Copy ``src`` (without weights) to ``dst`` with ``<think>``/``</think>`` added tokens."""
    return add_tokens(src, dst, ("<think>", "</think>"))


def add_tokens(src: Path, dst: Path, tokens: tuple[str, ...], *, special: bool = False) -> Path:
    """Copy ``src`` (without weights) to ``dst`` with ``tokens`` added to its tokenizer."""
    from tokenizers import AddedToken, Tokenizer

    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    if (src / "chat_template.jinja").is_file():
        shutil.copy(src / "chat_template.jinja", dst / "chat_template.jinja")
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    added = [AddedToken(t, normalized=False, special=special) for t in tokens]
    if special:
        tok.add_special_tokens(added)
    else:
        tok.add_tokens(added)
    tok.save(str(dst / "tokenizer.json"))
    return dst


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
