"""Fixtures of the tiered-cache unit tests."""

from __future__ import annotations

import pytest

from tests.skips import need
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


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    """A real ``mooncake_master`` on 127.0.0.1 (the remote tier's store)."""
    need("mooncake", why="the remote tier's store is Mooncake Store")
    from vllm_pd_ext.util.mooncake_master import mooncake_master

    with mooncake_master(tmp_path_factory.mktemp("mooncake") / "master.log") as m:
        yield m


@pytest.fixture
def remote(master):
    """A remote tier's settings on ``master``."""
    # a small segment per client: every engine here adds one
    return {"master": master.master, "segment_gb": 1 / 16, "buffer_mb": 16}
