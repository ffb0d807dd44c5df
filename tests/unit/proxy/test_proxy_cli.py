"""`vllm-pd proxy` flag, environment and file merging."""

from __future__ import annotations

import subprocess
import sys

from vllm_pd_ext.cli import build_parser
from vllm_pd_ext.proxy.cli import build_config


def test_file_env_and_flags_merge(tmp_path, monkeypatch):
    cfg_file = tmp_path / "proxy.yaml"
    cfg_file.write_text(
        "port: 9000\ninstances:\n  - {url: 'http://p:1', role: prefill}\n"
        "decision: {chars_per_token: 3.5}\n"
    )
    monkeypatch.setenv("VLLM_PD_PROXY_API_KEY", "from-env")
    args = build_parser().parse_args(
        [
            "proxy",
            "--config",
            str(cfg_file),
            "--decode",
            "http://d:2",
            "--port",
            "9100",
            "--min-split-prompt-tokens",
            "32",
            "--no-cost-model",
            "--decode-policy",
            "prefix-affinity",
        ]
    )
    config = build_config(args)
    assert config.port == 9100
    assert [(i.url, i.role) for i in config.instances] == [
        ("http://p:1", "prefill"),
        ("http://d:2", "decode"),
    ]
    assert config.api_key is not None and config.api_key.get_secret_value() == "from-env"
    assert config.decision.min_split_prompt_tokens == 32
    assert config.decision.cost_model is False
    assert config.decision.chars_per_token == 3.5
    assert config.decode_policy == "prefix-affinity"
    assert config.fast_path is True


def test_no_fast_path_flag_turns_the_fast_path_off():
    args = build_parser().parse_args(["proxy", "--decode", "http://d:2", "--no-fast-path"])
    assert build_config(args).fast_path is False


def test_invalid_config_exits_2_with_message():
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_pd_ext.cli", "proxy", "--decode", "not-a-url"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "invalid configuration" in proc.stderr and "http://" in proc.stderr
