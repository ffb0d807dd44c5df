"""The `vllm-pd` command: every part's subcommand is wired, and the parser stays light."""

from __future__ import annotations

import subprocess
import sys


def test_help_lists_every_subcommand():
    out = subprocess.run(
        [sys.executable, "-m", "vllm_pd_ext.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    for command in ("kv-size", "tiny-model", "demo", "proxy", "render"):
        assert command in out


def test_building_the_parser_imports_no_engine_code():
    code = (
        "import sys, vllm_pd_ext.cli as c; c.build_parser(); "
        "print(','.join(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert out.strip() == ""
