"""Fake engines shared by the proxy tests (module-scoped, reset before every test), and the
two server paths every proxy flow test runs on.

``server_path``: ``fast`` serves through ``front_protocol`` (the lean request cycle, direct
stream writes); ``plain`` turns it off (``fast_path: false``): uvicorn's own protocol and
the plain ASGI interface. On the plain path the test also fails if anything reached for the
request cycle behind the ASGI callables (what the fast path reads of uvicorn's internals).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import pytest

from tests.unit.proxy import helpers
from vllm_pd_ext.proxy import app, client_channel, front_protocol
from vllm_pd_ext.testing.fake_engine import Behavior, FakeEngine, start_engine

#: The modules whose tests drive a whole proxy (``helpers.proxy``) over the fake engines.
_FLOW_MODULES = (
    "test_hedge",
    "test_kubernetes_source",
    "test_migration",
    "test_mooncake_protocol",
    "test_moriio_pdext_protocols",
    "test_proxy_flow",
    "test_token_mode",
    "test_tracing",
)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.module.__name__.rpartition(".")[2] in _FLOW_MODULES and (
        "engines" in inspect.signature(metafunc.function).parameters
    ):
        metafunc.parametrize("server_path", ["fast", "plain"], indirect=True)


@pytest.fixture
def server_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    path = getattr(request, "param", "fast")
    monkeypatch.setattr(helpers, "FAST_PATH", path == "fast")
    reached: list[str] = []
    if path == "plain":

        def recorded(name, real):
            def call(*args, **kwargs):
                reached.append(name)
                return real(*args, **kwargs)

            return call

        monkeypatch.setattr(app, "fast_cycle", recorded("fast_cycle", app.fast_cycle))
        monkeypatch.setattr(
            client_channel, "hooked_cycle", recorded("hooked_cycle", client_channel.hooked_cycle)
        )
        writer = front_protocol.DirectWriter
        monkeypatch.setattr(writer, "__init__", recorded("DirectWriter", writer.__init__))
        cycle = front_protocol.FastCycle
        monkeypatch.setattr(cycle, "__init__", recorded("FastCycle", cycle.__init__))
    yield path
    assert reached == [], f"the plain path reached for uvicorn's internals: {reached}"


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, FakeEngine]]:
    started = {name: start_engine(name) for name in ("p1", "p2", "d1", "d2")}
    yield {name: engine for name, (engine, _) in started.items()}
    for _, thread in started.values():
        thread.__exit__(None, None, None)


@pytest.fixture(autouse=True)
def reset(request: pytest.FixtureRequest, server_path):
    if "engines" not in request.fixturenames:
        return
    for e in request.getfixturevalue("engines").values():
        e.behavior = Behavior()
        e.requests.clear()
        e.held_blocks.clear()
        e.disconnects = 0
        e.pulls = 0
        e.param_errors.clear()
        e.aborted.clear()
        e.kv_waits.clear()
