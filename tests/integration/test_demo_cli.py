"""The README's main job: `vllm-pd demo` runs a real P/D request end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import requires_nixl_pair

pytestmark = [pytest.mark.integration, requires_nixl_pair]


def test_demo_reports_kv_transfer_and_equal_output(model_cache, tiny_llama, tmp_path):
    env = {**os.environ, "VLLM_PD_EXT_CACHE": str(model_cache)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm_pd_ext.cli",
            "demo",
            "--json",
            "--prompt-tokens",
            "180",
            "--max-tokens",
            "16",
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    assert result["ok"] is True
    assert result["rounds"] == 5 and result["outputs_equal"] and result["kv_received"]
    assert result["prompt_tokens"] == 180
    assert result["decode_external_kv_tokens"] >= 179
    assert result["pd_token_ids"] == result["colocated_token_ids"]
    assert len(result["pd_token_ids"]) == 16
    assert result["pd_ttft_ms"] > 0 and result["colocated_ttft_ms"] > 0
    # NIXL's progress thread polls without pause in each idle engine: demo calmed both
    assert proc.stderr.count("lowered the CPU priority of 1 thread(s) polling while idle") == 2
    # Both servers were stopped: nothing is left listening in their process groups.
    assert "stopping servers" in proc.stderr
