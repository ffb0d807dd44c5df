"""Every example config validates against the model that reads it, and every `vllm-pd up`
example builds a stack whose proxy config validates (nothing is started)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_pd_ext.proxy.config import ProxyConfig
from vllm_pd_ext.tools.launcher import Stack, UpConfig
from vllm_pd_ext.util.config_file import read_mapping

EXAMPLES = Path(__file__).parent.parent.parent / "examples"
UP = sorted(EXAMPLES.glob("up-*.yaml"))


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_example_config_validates(path):
    data = read_mapping(path)
    model = UpConfig if path.name.startswith("up-") else ProxyConfig
    config = model.model_validate(data)
    assert config.model_dump()  # every field resolved


@pytest.mark.parametrize("path", UP, ids=lambda p: p.name)
def test_up_example_builds_a_valid_stack(path, tmp_path):
    data = {**read_mapping(path), "model": str(tmp_path), "log_dir": str(tmp_path / "logs")}
    config = UpConfig.model_validate(data)
    stack = Stack(config)
    try:
        stack.build()
    finally:
        stack.stop_all()  # nothing was started; removes the key it generated
    proxy = ProxyConfig.model_validate(json.loads((tmp_path / "logs" / "proxy.json").read_text()))
    assert proxy.token_mode == (config.mode == "token")
    assert len(proxy.render) == (config.render if config.mode == "token" else 0)
    assert sum(i.role == "prefill" for i in proxy.instances) == config.prefill
    assert sum(i.role == "decode" for i in proxy.instances) == config.decode


def test_examples_cover_the_issue_list():
    names = {p.name for p in EXAMPLES.glob("*.yaml")}
    assert {"up-cpu.yaml", "up-pdext.yaml", "up-token.yaml", "up-tiered-cache.yaml"} <= names
    assert {"up-gpu-xpyd.yaml", "proxy-token.yaml"} <= names
    tiered = UpConfig.model_validate(read_mapping(EXAMPLES / "up-tiered-cache.yaml"))
    assert tiered.flexkv is not None


def test_up_rejects_a_bad_flexkv_key():
    with pytest.raises(ValueError, match="cpu_capacity_gbs"):
        UpConfig(flexkv={"cpu_capacity_gbs": 1})
