"""Connector tests need vLLM (the real Scheduler) and, for transfers, Mooncake's engine."""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vLLM is not installed (connector tests drive its Scheduler)", allow_module_level=True
    )

from vllm_pd_ext import plugin

plugin.register()

HAVE_MOONCAKE = importlib.util.find_spec("mooncake") is not None
requires_mooncake = pytest.mark.skipif(
    not HAVE_MOONCAKE, reason="mooncake-transfer-engine(-non-cuda) is not installed"
)
