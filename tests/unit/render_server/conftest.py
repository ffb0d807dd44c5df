"""Fixtures for the render server tests: tiny-qwen with ``<think>`` / ``</think>`` added."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


def add_think_tokens(src: Path, dst: Path) -> Path:
    """Copy ``src`` (without weights) to ``dst`` with ``<think>``/``</think>`` added tokens."""
    from tokenizers import AddedToken, Tokenizer

    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    if (src / "chat_template.jinja").is_file():
        shutil.copy(src / "chat_template.jinja", dst / "chat_template.jinja")
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    tok.add_tokens([AddedToken(t, normalized=False) for t in ("<think>", "</think>")])
    tok.save(str(dst / "tokenizer.json"))
    return dst


@pytest.fixture(scope="session")
def tiny_qwen_think(tiny_qwen, tmp_path_factory) -> Path:
    return add_think_tokens(Path(tiny_qwen), tmp_path_factory.mktemp("tiny-qwen-think"))
