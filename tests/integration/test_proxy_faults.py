"""The proxy when real engines die: a killed decode mid-stream, a killed prefill mid-request.

Migration is off here (``--max-migrations 0``): a stream whose decode dies has nowhere it is
allowed to go on, so it ends with the error event (test_proxy_migration.py has it continued)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.integration.fleet_helpers import (
    running_proxy,
    stream_token_ids,
    wait_idle,
    wait_whole_fleet,
)
from vllm_pd_ext.tools.pd_demo import NIXL_CPU, make_prompt_ids
from vllm_pd_ext.util.prom import parse_metrics
from vllm_pd_ext.util.vllm_process import free_port

pytestmark = pytest.mark.integration

KV = {**NIXL_CPU, "kv_connector_extra_config": {"kv_lease_duration": 10}}


def start(vllm_servers, model, role, core, port=None, wait=True):
    """One NIXL engine; once healthy (``wait``), its idle pollers calmed (util/busy_threads)."""
    server = vllm_servers.start(
        model,
        name=f"faults-{role}-{int(time.time())}",
        wait=wait,
        cpu_core=core,
        port=port,
        kv_transfer_config=KV,
        env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
        extra_args=["--no-enable-prefix-caching"],
    )
    if wait:
        server.calm_idle_pollers()
    return server


@pytest.fixture(scope="module")
def fleet(vllm_servers, tiny_llama):
    prefill = start(vllm_servers, tiny_llama, "prefill", 0, wait=False)
    decode = start(vllm_servers, tiny_llama, "decode", 1, wait=False)
    for server in (prefill, decode):
        server.wait_healthy()
    for server in (prefill, decode):
        server.calm_idle_pollers()
    return {"prefill": prefill, "decode": decode}


@pytest.fixture(scope="module")
def proxy_url(fleet, tmp_path_factory):
    log = tmp_path_factory.mktemp("proxy-faults") / "proxy.log"
    args = [
        "--prefill",
        fleet["prefill"].base_url,
        "--decode",
        fleet["decode"].base_url,
        "--min-split-prompt-tokens",
        "64",
        "--no-cost-model",
        "--max-migrations",
        "0",
    ]
    with running_proxy(args, log) as url:
        yield url


def proxy_metric(proxy_url: str, name: str, **labels: str) -> float:
    return parse_metrics(httpx.get(f"{proxy_url}/metrics", timeout=30).text).total(name, **labels)


@pytest.fixture
def whole(fleet, proxy_url, vllm_servers, tiny_llama):
    """The fleet whole at the start of each test: an engine an earlier test killed is started
    again on its port, so no test depends on another having run or on their order. A test
    that kills an engine leaves it dead: the next test that needs it pays the restart, and
    none is paid after the module's last kill."""
    for role, core in (("prefill", 0), ("decode", 1)):
        server = fleet[role]
        if server.proc.poll() is not None:
            server.stop()
            fleet[role] = start(vllm_servers, tiny_llama, role, core, port=server.port)
    wait_whole_fleet(proxy_url)
    return fleet


def body(model: str, prompt: list[int], **extra) -> dict:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }


def colocated_ids(server, payload: dict) -> list[int]:
    """The token ids ``server`` alone answers ``payload`` with (the greedy reference)."""
    resp = httpx.post(f"{server.base_url}/v1/completions", json=payload, timeout=120)
    return resp.json()["choices"][0]["token_ids"]


def test_a_frozen_decode_is_a_stall_then_down_and_the_prefill_instance_serves_requests_whole(
    whole, proxy_url, tiny_llama
):
    """Degraded modes on real engines. The decode engine freezes (SIGSTOP): a split stream's
    decode leg gets no answer, so the request is served colocated on the prefill instance
    (which just computed its prompt): by the stall guard's hedge, started beside the late
    split, or past the deadline behind it on a host too busy for the hedge; once the proxy's
    health checks find the decode down, long prompts are served whole on the prefill
    instance; both answers are greedy colocated's, and both fallbacks counted."""
    prefill, decode = whole["prefill"], whole["decode"]
    payload = body(decode.served_name, make_prompt_ids(tiny_llama, 200))
    expected = colocated_ids(decode, payload)

    def guard_fallbacks() -> float:
        return sum(
            proxy_metric(proxy_url, "vllm_pd_fallbacks_total", reason=reason)
            for reason in ("hedge", "stall")
        )

    stalls = guard_fallbacks()
    no_decode = proxy_metric(proxy_url, "vllm_pd_fallbacks_total", reason="no_decode")
    prefill_served = prefill.metric("vllm:request_success_total")
    os.killpg(decode.proc.pid, signal.SIGSTOP)
    try:
        # health checks take seconds to give up on a silent engine; the guard's floor is 2 s
        assert stream_token_ids(proxy_url, payload) == expected
        assert guard_fallbacks() - stalls == 1
        # the prefill leg and the colocated answer, both on the prefill instance
        assert prefill.metric("vllm:request_success_total") - prefill_served == 2

        deadline = time.monotonic() + 120
        while httpx.get(f"{proxy_url}/health", timeout=30).json().get("healthy_decode") != 0:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        health = httpx.get(f"{proxy_url}/health", timeout=30)
        assert health.status_code == 200 and health.json()["status"] == "degraded_no_decode"
        resp = httpx.post(f"{proxy_url}/v1/completions", json=payload, timeout=120)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["token_ids"] == expected
        moved = proxy_metric(proxy_url, "vllm_pd_fallbacks_total", reason="no_decode") - no_decode
        assert moved == 1
    finally:
        os.killpg(decode.proc.pid, signal.SIGCONT)
        wait_whole_fleet(proxy_url)
    wait_idle(prefill)  # the abandoned split's blocks are released (the lease at the latest)
    wait_idle(decode)


def test_prefill_killed_mid_request_falls_back_to_colocated(whole, proxy_url, tiny_llama):
    prefill, decode = whole["prefill"], whole["decode"]
    payload = body(decode.served_name, make_prompt_ids(tiny_llama, 200))
    expected = colocated_ids(decode, payload)
    failed = proxy_metric(proxy_url, "vllm_pd_fallbacks_total", reason="prefill_failed")
    no_prefill = proxy_metric(proxy_url, "vllm_pd_decisions_total", reason="no_prefill")
    try:
        os.killpg(prefill.proc.pid, signal.SIGSTOP)  # the prefill leg will hang...
        result: dict = {}

        def send():
            result["resp"] = httpx.post(f"{proxy_url}/v1/completions", json=payload, timeout=120)

        sender = threading.Thread(target=send)
        sender.start()
        deadline = time.monotonic() + 60
        while not proxy_metric(proxy_url, "vllm_pd_upstream_in_flight", role="prefill"):
            assert sender.is_alive() and time.monotonic() < deadline, result
            time.sleep(0.1)
        os.killpg(prefill.proc.pid, signal.SIGKILL)  # ...until the prefill dies under it
        sender.join(timeout=120)
        resp = result["resp"]
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["token_ids"] == expected
        fallbacks = proxy_metric(proxy_url, "vllm_pd_fallbacks_total", reason="prefill_failed")
        assert fallbacks - failed == 1
        wait_idle(decode)
        # The proxy took the dead prefill out of rotation: the next long prompt runs colocated.
        resp = httpx.post(f"{proxy_url}/v1/completions", json=payload, timeout=120)
        assert resp.status_code == 200
        assert resp.json()["choices"][0]["token_ids"] == expected
        decided = proxy_metric(proxy_url, "vllm_pd_decisions_total", reason="no_prefill")
        assert decided - no_prefill == 1
    finally:  # dead, not frozen, whatever failed: the next test that needs it starts it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(prefill.proc.pid, signal.SIGKILL)
        prefill.proc.wait(timeout=30)


def test_decode_killed_mid_stream_ends_with_error_event(whole, proxy_url, tiny_llama, vllm_servers):
    # A tiny model can send all its tokens before the client has read the first one (vLLM
    # coalesces tokens when the reader lags), so a kill can come after the decode finished: such
    # a try proves nothing and is tried again, a few times at most.
    max_tokens = 350
    for attempt in range(3):
        prefill, decode = whole["prefill"], whole["decode"]
        payload = body(
            decode.served_name,
            make_prompt_ids(tiny_llama, 150),
            max_tokens=max_tokens,
            stream=True,
        )
        events: list[str] = []
        tokens = 0
        with httpx.stream("POST", f"{proxy_url}/v1/completions", json=payload, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line)
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:]).get("choices", []):
                        tokens += len(choice.get("token_ids") or [])
                if len(events) == 1:
                    # Freeze it at once, then kill it.
                    os.killpg(decode.proc.pid, signal.SIGSTOP)
                    os.killpg(decode.proc.pid, signal.SIGKILL)
        decode.proc.wait(timeout=30)  # dead for sure: ``whole`` restarts what is dead
        if events[-1] == "data: [DONE]" and tokens == max_tokens:
            if attempt < 2:  # every token was sent before the kill: again, on a new decode
                decode.stop()
                whole["decode"] = start(vllm_servers, tiny_llama, "decode", 1, port=decode.port)
                wait_whole_fleet(proxy_url)
            continue
        assert events[-1] != "data: [DONE]", (tokens, events[-3:])
        last = json.loads(events[-1][6:])
        assert last["error"]["code"] == 502, events[-3:]
        assert "mid-stream" in last["error"]["message"]
        wait_idle(prefill)  # the decode had pulled the KV before its first token
        return  # the decode stays dead: the next test that needs it starts it (``whole``)
    pytest.fail(f"the decode finished all {max_tokens} tokens before each of 3 kills")
