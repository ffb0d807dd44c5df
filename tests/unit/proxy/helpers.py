"""Helpers shared by the proxy tests: a proxy on loopback over the fake engines."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from vllm_pd_ext.proxy.app import create_app
from vllm_pd_ext.proxy.config import ProxyConfig
from vllm_pd_ext.proxy.service import ProxyService
from vllm_pd_ext.testing.fake_engine import FakeEngine, ServerThread
from vllm_pd_ext.util.prom import parse_metrics

#: Serve through the fast path (the ``server_path`` fixture sets it per test).
FAST_PATH = True

LONG = "word " * 400  # ~500 estimated tokens: above the default split threshold
SHORT = "hi there"


def fleet(engines, prefill=("p1", "p2"), decode=("d1", "d2")) -> list[dict]:
    return [{"url": engines[n].url, "role": "prefill"} for n in prefill] + [
        {"url": engines[n].url, "role": "decode"} for n in decode
    ]


@contextmanager
def proxy(engines, tracing=None, **overrides) -> Iterator[tuple[str, ProxyService]]:
    # no hedge unless a test asks (test_hedge.py): on a loaded host any split of the fake
    # engines may run past its least delay, and a hedge would serve it colocated instead
    guard = {"hedge": False, **overrides.pop("stall_guard", {})}
    data = {
        "instances": fleet(engines),
        "health_interval_s": 0.2,
        "decision": {"cost_model": False},
        "prefill_policy": "round-robin",
        "decode_policy": "round-robin",
        "fast_path": FAST_PATH,
        "stall_guard": guard,
        **overrides,
    }
    config = ProxyConfig.model_validate(data)
    app = create_app(config, tracing=tracing)
    # the protocol `vllm-pd proxy` serves with
    with ServerThread(app, http=app.server_protocol()) as server:
        yield f"http://127.0.0.1:{server.port}", app.state.service


def wait_until(predicate, timeout=30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail("condition not reached in time")
        time.sleep(0.02)


def metric(base: str, name: str, **labels) -> float:
    return parse_metrics(httpx.get(f"{base}/metrics", timeout=60).text).total(name, **labels)


def sent(engine: FakeEngine) -> list[dict]:
    return [r["body"] for r in engine.requests]
