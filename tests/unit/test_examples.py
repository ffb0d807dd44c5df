"""Every example config validates against the model that reads it."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_pd_ext.proxy.config import ProxyConfig, read_mapping
from vllm_pd_ext.tools.launcher import UpConfig

EXAMPLES = Path(__file__).parent.parent.parent / "examples"


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_example_config_validates(path):
    data = read_mapping(path)
    model = UpConfig if path.name.startswith("up-") else ProxyConfig
    config = model.model_validate(data)
    assert config.model_dump()  # every field resolved
