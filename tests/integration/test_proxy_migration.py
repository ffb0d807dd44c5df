"""Request migration on real engines: one prefill and two decode `vllm serve`; a decode killed
mid-stream, and the client's stream finished on the other decode as if nothing happened."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

import httpx
import pytest

from tests.integration.fleet_helpers import running_proxy
from vllm_pd_ext.tools.pd_demo import NIXL_CPU, make_prompt_ids
from vllm_pd_ext.util.prom import parse_metrics
from vllm_pd_ext.util.vllm_process import free_port

pytestmark = pytest.mark.integration

KV = {**NIXL_CPU, "kv_connector_extra_config": {"kv_lease_duration": 10}}
#: role -> CPU core (two decodes: the host has two cores)
CORES = {"prefill": 0, "decode-a": 1, "decode-b": 0}
ROUTES = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
MAX_TOKENS = 300


def start(vllm_servers, model, role, port=None, wait=True):
    """One NIXL engine; once healthy (``wait``), its idle pollers calmed (util/busy_threads)."""
    server = vllm_servers.start(
        model,
        name=f"migration-{role}-{int(time.time())}",
        wait=wait,
        cpu_core=CORES[role],
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
    # one after another: two engines warming up on one core at once can miss the health
    # deadline on a loaded host
    return {role: start(vllm_servers, tiny_llama, role) for role in CORES}


@pytest.fixture(scope="module")
def proxy_url(fleet, tmp_path_factory):
    log = tmp_path_factory.mktemp("proxy-migration") / "proxy.log"
    args = ["--prefill", fleet["prefill"].base_url]
    for role in ("decode-a", "decode-b"):
        args += ["--decode", fleet[role].base_url]
    args += ["--min-split-prompt-tokens", "64", "--no-cost-model", "--max-migrations", "1"]
    with running_proxy(args, log) as url:
        yield url


def metrics(proxy_url: str):
    return parse_metrics(httpx.get(f"{proxy_url}/metrics", timeout=30).text)


def wait_whole_fleet(proxy_url: str, timeout: float = 180.0) -> None:
    """Until the proxy sees every instance healthy (each test restores what it kills)."""
    deadline = time.monotonic() + timeout
    doc: dict = {}
    while doc.get("healthy_prefill") != 1 or doc.get("healthy_decode") != 2:
        assert time.monotonic() < deadline, doc
        time.sleep(0.2)
        with contextlib.suppress(httpx.HTTPError, ValueError):
            doc = httpx.get(f"{proxy_url}/health", timeout=5).json()


def request_body(route: str, model: str, tiny_llama) -> dict:
    body: dict = {
        "model": model,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if route == "chat":  # long enough to be split
        body["messages"] = [{"role": "user", "content": "Tell me a long story. " * 40}]
    else:
        body["prompt"] = make_prompt_ids(tiny_llama, 150)
        body["return_token_ids"] = True  # the client's own: they come through
    return body


def stream(proxy_url: str, route: str, body: dict, on_first=None) -> list:
    """The stream's events, parsed (``[DONE]`` as the string); ``on_first()`` runs once the
    first event with generated text has arrived."""
    events: list = []
    with httpx.stream("POST", f"{proxy_url}{ROUTES[route]}", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(json.loads(line[6:]) if line.startswith("data: {") else line[6:])
            if on_first is not None and _text(events[-1:], route):
                on_first()
                on_first = None
    return events


def _text(events: list, route: str) -> str:
    out = []
    for e in events:
        for c in e.get("choices", []) if isinstance(e, dict) else []:
            out.append(
                (c.get("delta") or {}).get("content") or "" if route == "chat" else c["text"]
            )
    return "".join(out)


def _ids(events: list) -> list[int]:
    return [t for e in events if isinstance(e, dict) for c in e["choices"] for t in c["token_ids"]]


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_a_decode_killed_mid_stream_is_continued_on_the_other_one(
    fleet, proxy_url, tiny_llama, vllm_servers, route
):
    wait_whole_fleet(proxy_url)
    body = request_body(route, fleet["prefill"].served_name, tiny_llama)
    whole = stream(proxy_url, route, body)
    assert whole[-1] == "[DONE]"
    # A tiny model can send all its tokens before the client has read the first one, so a
    # kill can come after the decode finished: such a try proves nothing and is tried
    # again, a few times at most.
    for _ in range(3):
        wait_whole_fleet(proxy_url)
        continued = metrics(proxy_url).total("vllm_pd_migrations_total", outcome="continued")
        killed: list = []

        def kill(killed: list = killed) -> None:
            # the decode instance the proxy streams from: its in-flight count says which
            seen = metrics(proxy_url)
            for role in ("decode-a", "decode-b"):
                server = fleet[role]
                if seen.total("vllm_pd_upstream_in_flight", instance=server.base_url):
                    os.killpg(server.proc.pid, signal.SIGSTOP)  # freeze it at once, then kill
                    os.killpg(server.proc.pid, signal.SIGKILL)
                    killed.append(role)
                    return

        try:
            events = stream(proxy_url, route, body, on_first=kill)
        finally:
            for role in killed:  # the decode instance back on the same port
                old = fleet[role]
                old.stop()
                fleet[role] = start(vllm_servers, tiny_llama, role, port=old.port)
        moved = metrics(proxy_url).total("vllm_pd_migrations_total", outcome="continued")
        if not killed or moved == continued:
            continue  # the stream was over before the kill: try again
        assert moved - continued == 1
        assert events[-1] == "[DONE]"
        assert not any("error" in e for e in events if isinstance(e, dict)), events[-3:]
        assert _text(events, route) == _text(whole, route)
        if route == "completions":
            assert _ids(events) == _ids(whole) and len(_ids(events)) == MAX_TOKENS
        chunks = [e for e in events if isinstance(e, dict)]
        assert len({(c["id"], c["model"], c["created"]) for c in chunks}) == 1
        assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
        assert chunks[-1]["usage"]["prompt_tokens"] == whole[-2]["usage"]["prompt_tokens"]
        finishes = [c["finish_reason"] for e in chunks for c in e["choices"] if c["finish_reason"]]
        assert finishes == ["length"]
        wait_whole_fleet(proxy_url)
        return
    pytest.fail(f"the decode finished all {MAX_TOKENS} tokens before each of 3 kills")
