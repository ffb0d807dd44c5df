"""Fixtures of the tiered-cache unit tests."""

from __future__ import annotations

import pytest

from tests.unit.connectors.flexkv.engine import Engine, flexkv_config


@pytest.fixture
def engine_factory(tiny_qwen, tmp_path):
    made = []

    def make(policy: str = "recompute", **extra) -> Engine:
        extra.setdefault("cpu_capacity_blocks", 32)
        e = Engine(flexkv_config(tiny_qwen, extra, policy))
        made.append(e)
        return e

    yield make
    for e in made:
        e.worker.shutdown()
