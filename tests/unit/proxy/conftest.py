"""Fake engines shared by the proxy tests (module-scoped, reset before every test)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from vllm_pd_ext.testing.fake_engine import Behavior, FakeEngine, start_engine


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, FakeEngine]]:
    started = {name: start_engine(name) for name in ("p1", "p2", "d1", "d2")}
    yield {name: engine for name, (engine, _) in started.items()}
    for _, thread in started.values():
        thread.__exit__(None, None, None)


@pytest.fixture(autouse=True)
def reset(engines):
    for e in engines.values():
        e.behavior = Behavior()
        e.requests.clear()
        e.held_blocks.clear()
        e.disconnects = 0
        e.pulls = 0
        e.param_errors.clear()
        e.aborted.clear()
