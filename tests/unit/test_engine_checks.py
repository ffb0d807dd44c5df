"""The doctor's engine checks: which KV counters rose between two scrapes (what vLLM's
NixlConnector, our connectors and vLLM itself export), and an engine's CPU while idle,
measured on real local processes that answer /metrics as vLLM does."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import time
from functools import partial
from types import SimpleNamespace

import httpx
import pytest

from tests.conftest import requires_vllm
from vllm_pd_ext.tools.engine_checks import (
    BLOCKS_HELD,
    KV_COUNTERS,
    EngineIdle,
    connector_of,
    counter_moves,
    measure_idle,
)
from vllm_pd_ext.util.prom import parse_metrics

PDEXT = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} {running}
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="m"}} 0.0
# TYPE vllm:pdext_kv_lease_expiries_total counter
vllm:pdext_kv_lease_expiries_total{{engine="0",model_name="m"}} {expiries}
# TYPE vllm:pdext_kv_transfer_failures_total counter
vllm:pdext_kv_transfer_failures_total{{engine="0",model_name="m"}} 0.0
# TYPE vllm:pdext_kv_blocks_held gauge
vllm:pdext_kv_blocks_held{{engine="0",model_name="m"}} {held}
# TYPE vllm:request_success_total counter
vllm:request_success_total{{engine="0",finished_reason="stop",model_name="m"}} 7.0
vllm:request_success_total{{engine="0",finished_reason="error",model_name="m"}} {errors}
"""

NIXL = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} 0.0
# TYPE vllm:nixl_num_failed_transfers_total counter
vllm:nixl_num_failed_transfers_total{{engine="0",model_name="m"}} 0.0
# TYPE vllm:nixl_num_kv_expired_reqs_total counter
vllm:nixl_num_kv_expired_reqs_total{{engine="0",model_name="m"}} {expired}
# TYPE vllm:nixl_num_notifications_after_expiry_total counter
vllm:nixl_num_notifications_after_expiry_total{{engine="0",model_name="m"}} {late}
"""


def _pdext(running=0, expiries=0, held=0, errors=0):
    return parse_metrics(PDEXT.format(running=running, expiries=expiries, held=held, errors=errors))


def _nixl(expired=0, late=0):
    return parse_metrics(NIXL.format(expired=expired, late=late))


def test_no_counter_moved_no_move():
    assert counter_moves("prefill", "u", _pdext(expiries=3), _pdext(expiries=3)) == []


def test_a_lease_expiry_on_our_connector_is_named():
    (move,) = counter_moves("prefill", "http://p", _pdext(expiries=1), _pdext(expiries=3))
    assert move.counter == "vllm:pdext_kv_lease_expiries_total" and move.moved == 2
    assert "freed before a decode instance read them" in str(move)
    assert str(move).startswith("prefill http://p: vllm:pdext_kv_lease_expiries_total rose by 2")


def test_nixl_notifications_after_expiry_say_invalid_kv_may_have_been_read():
    moves = counter_moves("prefill", "u", _nixl(), _nixl(expired=1, late=1))
    assert [m.counter for m in moves] == [
        "vllm:nixl_num_kv_expired_reqs_total",
        "vllm:nixl_num_notifications_after_expiry_total",
    ]
    assert "INVALID KV MAY HAVE BEEN READ" in str(moves[1])


def test_requests_ended_in_error_count_only_the_error_reason():
    (move,) = counter_moves("decode", "u", _pdext(errors=0), _pdext(errors=2))
    assert move.counter == 'vllm:request_success_total{finished_reason="error"}'
    assert move.moved == 2


def test_a_counter_an_engine_does_not_export_never_moves():
    assert counter_moves("decode", "u", _nixl(), _pdext()) == []


def test_the_connector_is_told_by_its_metrics():
    assert connector_of(_nixl()) == "nixl"
    assert connector_of(_pdext()) == "pdext"
    assert connector_of(parse_metrics("vllm:num_requests_running 0\n")) == ""


class _Recorded:
    """Stands in for prometheus_client's metric classes: records the names registered."""

    names: list[tuple[str, str]] = []

    def __init__(self, kind: str, name: str, **_: object) -> None:
        self.names.append((kind, name))

    def labels(self, *_: object) -> _Recorded:
        return self


@requires_vllm
def test_every_connector_counter_is_one_the_connectors_register():
    """Each name the doctor reads is a counter our connectors or vLLM's NixlConnector
    register (their Prometheus classes, with recording metric types), or vLLM's own."""
    from prometheus_client import Counter, Gauge, Histogram
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlPromMetrics
    from vllm.v1.metrics import loggers

    from vllm_pd_ext.connectors.common.stats import PdTransferPromMetrics

    _Recorded.names = []
    types = {kind: partial(_Recorded, kind.__name__) for kind in (Counter, Gauge, Histogram)}
    config = SimpleNamespace(kv_transfer_config=None)
    for cls in (PdTransferPromMetrics, NixlPromMetrics):
        cls(config, types, ["model_name", "engine"], {0: ["m", "0"]})
    counters = {name for kind, name in _Recorded.names if kind == "Counter"}
    assert ("Gauge", BLOCKS_HELD) in _Recorded.names
    for c in KV_COUNTERS:
        base = c.sample.removesuffix("_total")
        if c.sample.startswith(("vllm:pdext_", "vllm:nixl_")):
            assert base in counters, c.sample
        else:
            assert f'name="{base}"' in inspect.getsource(loggers), c.sample


# -- idle CPU, on real processes ---------------------------------------------------------------

# An HTTP server on 127.0.0.1 answering /metrics with the text in $METRICS; with $SPIN set,
# one thread polls without pause, as NIXL's progress thread does. Prints its port and the
# polling thread's id.
ENGINE = r"""
import http.server, os, threading
text = os.environ["METRICS"].encode()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", str(len(text)))
        self.end_headers(); self.wfile.write(text)
    def log_message(self, *a): pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
if os.environ.get("SPIN"):
    def spin():
        while True:
            pass
    t = threading.Thread(target=spin, daemon=True)
    t.start()
print(server.server_address[1], t.native_id if os.environ.get("SPIN") else 0, flush=True)
server.serve_forever()
"""


@pytest.fixture
def start_engine():
    procs: list[subprocess.Popen] = []

    def start(metrics: str, spin: bool = False) -> tuple[str, int]:
        """(its URL, the polling thread's id or 0)"""
        env = {**os.environ, "METRICS": metrics, **({"SPIN": "1"} if spin else {})}
        proc = subprocess.Popen(
            [sys.executable, "-c", ENGINE], stdout=subprocess.PIPE, text=True, env=env
        )
        procs.append(proc)
        assert proc.stdout is not None
        port, tid = proc.stdout.readline().split()
        return f"http://127.0.0.1:{port}", int(tid)

    yield start
    for proc in procs:
        proc.kill()
        proc.wait(timeout=10)


def _scrape(url: str):
    return parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text)


def _wait_listening(*urls: str) -> None:
    deadline = time.monotonic() + 30
    for url in urls:
        while True:
            try:
                httpx.get(f"{url}/metrics", timeout=2)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline
                time.sleep(0.1)


def test_an_idle_engine_that_polls_is_warned_about_and_a_quiet_one_is_not(start_engine):
    nixl, poller = start_engine(NIXL.format(expired=0, late=0), spin=True)
    quiet, _ = start_engine(PDEXT.format(running=0, expiries=0, held=0, errors=0))
    _wait_listening(nixl, quiet)
    deadline = time.monotonic() + 30
    while True:  # one spinning thread gets a fair share of a core, on a loaded host not always
        polling, calm = measure_idle({"prefill": nixl, "decode": quiet}, _scrape, 1.0)
        assert polling.role == "prefill" and polling.cpu_pct is not None
        if polling.cpu_pct > 20 and polling.busy_threads:
            break
        assert time.monotonic() < deadline, polling
    assert f"({poller}): " in polling.busy_threads[0], polling
    warning = polling.warning(20)
    assert warning is not None and "busy-polls" in warning and "NixlConnector" in warning
    assert calm.cpu_pct is not None and calm.cpu_pct < 20 and calm.warning(20) is None
    assert "idle CPU" in calm.line()


def test_an_engine_serving_requests_is_not_measured(start_engine):
    busy, _ = start_engine(PDEXT.format(running=2, expiries=0, held=0, errors=0))
    _wait_listening(busy)
    (idle,) = measure_idle({"decode": busy}, _scrape, 0.5)
    assert idle.cpu_pct is None and idle.note == "not idle: 2 running, 0 waiting"
    assert idle.warning() is None


def test_a_remote_engine_is_not_measured():
    (idle,) = measure_idle({"decode": "http://192.0.2.7:8000"}, _scrape, 0.5)
    assert idle == EngineIdle("decode", "http://192.0.2.7:8000", None, "not on this host")
    assert idle.line() == "decode http://192.0.2.7:8000: idle CPU n/a (not on this host)"


def test_an_engine_holding_blocks_is_said_to_step_for_them():
    idle = EngineIdle("prefill", "u", 130.0, blocks_held=4, connector="pdext")
    warning = idle.warning()
    assert warning is not None and "holds 4 KV blocks" in warning
