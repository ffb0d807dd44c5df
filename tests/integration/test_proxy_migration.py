"""Request migration on real engines: one prefill and two decode `vllm serve`
(PdExtMoRIIOConnector, pdext-read, ``--enable-scale-out``); a decode killed mid-stream, and the
client's stream finished on another instance as if nothing happened, in text mode and in token
mode (our render server in front: the engines see token ids, the stream is derendered).

The kill needs no timing luck: when the client has its first few tokens, every live decode
engine is frozen (SIGSTOP) at once, so the one streaming cannot finish; the proxy's
in-flight gauge then says which one holds the stream, the others are thawed and the holder
killed. The answer is long (``MAX_TOKENS`` in a ``MAX_MODEL_LEN`` context) so that a decode
has not sent it whole by the time the client reads its first events.

The engines are the module's: a test kills one decode and leaves it dead. The next test
needs only one live decode to stream from (the continuation goes to the other decode, or,
with none left, colocated to the prefill instance), so the decodes are started again only
when none is live (once in the module's four tests, both together).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.integration.fleet_helpers import FLEET_KEY, pdext_connector, running_proxy
from tests.integration.fleet_helpers import wait_whole_fleet as wait_fleet
from vllm_pd_ext import fleet_key
from vllm_pd_ext.render_server.app import create_app as create_render_app
from vllm_pd_ext.render_server.settings import RenderSettings
from vllm_pd_ext.testing.fake_engine import ServerThread
from vllm_pd_ext.tools.pd_demo import make_prompt_ids
from vllm_pd_ext.util.prom import parse_metrics
from vllm_pd_ext.util.vllm_process import free_port

pytestmark = pytest.mark.integration

#: role -> (kv_role, CPU core); two decodes: the host has two cores
ROLES = {
    "prefill": ("kv_producer", 0),
    "decode-a": ("kv_consumer", 1),
    "decode-b": ("kv_consumer", 0),
}
DECODES = ("decode-a", "decode-b")
ROUTES = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
MAX_TOKENS = 600
#: Room for the longest prompt here (~130 tokens) and ``MAX_TOKENS``: vLLM cuts a request's
#: ``max_tokens`` to what its context leaves, which would make the answer shorter than asked.
MAX_MODEL_LEN = 1024
#: Events with text the client reads before the kill: the continuation starts from the
#: prompt and several generated tokens.
KILL_AFTER = 8
#: The continuation computes the prompt and the ids generated so far in one prefill, where
#: the first leg decoded them one by one: in bfloat16 that rounding difference flips a random
#: model's near-ties in a 600-token answer now and then; float32 keeps greedy runs equal.
FLOAT32 = ("--dtype", "float32")
#: Seconds an engine may take to be healthy (it warms up on a core shared with others).
HEALTHY_WITHIN = 600


def start(vllm_servers, model, role, side_port, port=None, wait=True):
    """One PdExtMoRIIOConnector engine (single rank, the harness's ``uni`` executor)."""
    kv_role, core = ROLES[role]
    server = vllm_servers.start(
        model,
        name=f"migration-{role}-{int(time.time())}",
        wait=False,
        cpu_core=core,
        port=port,
        kv_transfer_config=pdext_connector(kv_role, side_port),
        env={fleet_key.KEY_ENV: FLEET_KEY},
        base_args=("--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager", *FLOAT32),
        extra_args=["--no-enable-prefix-caching", "--enable-scale-out"],
    )
    if wait:
        server.wait_healthy(HEALTHY_WITHIN)
    return server


@pytest.fixture(scope="module")
def fleet(vllm_servers, tiny_llama):
    """role -> server, started together; ``"side"``: the prefill's side-channel port."""
    ports = {role: free_port() for role in ROLES}
    servers = {
        role: start(vllm_servers, tiny_llama, role, ports[role], wait=False) for role in ROLES
    }
    for server in servers.values():
        server.wait_healthy(HEALTHY_WITHIN)
    return {**servers, "ports": ports}


@pytest.fixture(scope="module")
def render_url(fleet, tiny_llama) -> Iterator[str]:
    """Our render server, in this process."""
    settings = RenderSettings(model=str(tiny_llama), served_model_name=fleet["prefill"].served_name)
    with ServerThread(create_render_app(settings)) as server:
        yield f"http://127.0.0.1:{server.port}"


@pytest.fixture(scope="module")
def proxies(fleet, render_url, tmp_path_factory) -> Iterator[dict[str, str]]:
    """mode (text, token) -> the URL of a proxy in front of the fleet."""
    with contextlib.ExitStack() as stack:
        yield {
            mode: stack.enter_context(proxy(fleet, tmp_path_factory, render))
            for mode, render in (("text", []), ("token", [render_url]))
        }


@contextlib.contextmanager
def proxy(fleet, tmp_path_factory, render: list[str]) -> Iterator[str]:
    here = tmp_path_factory.mktemp("proxy-migration")
    prefill = {
        "url": fleet["prefill"].base_url,
        "role": "prefill",
        "bootstrap_addr": f"127.0.0.1:{fleet['ports']['prefill']}",
    }
    config = {
        "protocol": "pdext-read",
        "instances": [prefill] + [{"url": fleet[r].base_url, "role": "decode"} for r in DECODES],
        "decision": {"min_split_prompt_tokens": 64, "cost_model": False},
        # a decode slow to its first token on a loaded host must not send the request
        # colocated to the prefill instance: the test kills the decode that streams it
        "stall_guard": {"enabled": False},
        "max_migrations": 1,
        "render": render,
    }
    (here / "proxy.json").write_text(json.dumps(config))
    with running_proxy(["--config", str(here / "proxy.json")], here / "proxy.log") as url:
        yield url


def live_decodes(fleet: dict) -> list[str]:
    return [role for role in DECODES if fleet[role].proc.poll() is None]


@pytest.fixture
def ready(fleet, proxies, vllm_servers, tiny_llama):
    """The prefill and at least one decode live, and the proxies seeing exactly the live
    ones healthy; when no decode is live, both are started again together (on their
    ports)."""
    if not live_decodes(fleet):
        for role in DECODES:
            old = fleet[role]
            old.stop()
            fleet[role] = start(
                vllm_servers, tiny_llama, role, fleet["ports"][role], port=old.port, wait=False
            )
        for role in DECODES:
            fleet[role].wait_healthy(HEALTHY_WITHIN)
    for url in proxies.values():
        wait_fleet(url, prefill=1, decode=len(live_decodes(fleet)), timeout=HEALTHY_WITHIN)
    return fleet


def metrics(proxy_url: str):
    return parse_metrics(httpx.get(f"{proxy_url}/metrics", timeout=30).text)


def request_body(route: str, model: str, tiny_llama) -> dict:
    body: dict = {
        "model": model,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if route == "chat":  # long enough to be split (~120 tokens rendered)
        body["messages"] = [{"role": "user", "content": "Tell me a long story. " * 12}]
    else:
        body["prompt"] = make_prompt_ids(tiny_llama, 100)
        body["return_token_ids"] = True  # the client's own: they come through
    return body


def stream(proxy_url: str, route: str, body: dict, on_text=None) -> list:
    """The stream's events, parsed (``[DONE]`` as the string); ``on_text()`` runs once
    ``KILL_AFTER`` events with generated text have arrived."""
    events: list = []
    texts = 0
    with httpx.stream("POST", f"{proxy_url}{ROUTES[route]}", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(json.loads(line[6:]) if line.startswith("data: {") else line[6:])
            texts += bool(_text(events[-1:], route))
            if on_text is not None and texts == KILL_AFTER:
                on_text()
                on_text = None
    return events


def kill_the_streaming_decode(fleet: dict, proxy_url: str) -> str | None:
    """Freeze the live decodes, kill the one the proxy streams from, thaw the others; the
    role killed (None: none held a stream, all thawed)."""
    live = live_decodes(fleet)
    for role in live:
        os.killpg(fleet[role].proc.pid, signal.SIGSTOP)
    seen = metrics(proxy_url)
    held = [
        role
        for role in live
        if seen.total("vllm_pd_upstream_in_flight", instance=fleet[role].base_url)
    ]
    for role in live:
        if role not in held[:1]:
            os.killpg(fleet[role].proc.pid, signal.SIGCONT)
    if not held:
        return None
    os.killpg(fleet[held[0]].proc.pid, signal.SIGKILL)
    fleet[held[0]].proc.wait(timeout=30)
    return held[0]


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
@pytest.mark.parametrize("mode", ["text", "token"])
def test_a_decode_killed_mid_stream_is_continued_on_another_instance(
    ready, proxies, tiny_llama, mode, route
):
    fleet, proxy_url = ready, proxies[mode]
    body = request_body(route, fleet["prefill"].served_name, tiny_llama)
    whole = stream(proxy_url, route, body)
    assert whole[-1] == "[DONE]"
    assert whole[-2]["usage"]["completion_tokens"] == MAX_TOKENS
    continued = metrics(proxy_url).total("vllm_pd_migrations_total", outcome="continued")
    killed: list = []
    events = stream(
        proxy_url,
        route,
        body,
        on_text=lambda: killed.append(kill_the_streaming_decode(fleet, proxy_url)),
    )
    assert killed and killed[0] in DECODES, "no decode held the stream when it was frozen"
    moved = metrics(proxy_url).total("vllm_pd_migrations_total", outcome="continued")
    assert moved - continued == 1
    assert events[-1] == "[DONE]"
    assert not any("error" in e for e in events if isinstance(e, dict)), events[-3:]
    assert _text(events, route) == _text(whole, route)
    chunks = [e for e in events if isinstance(e, dict)]
    if mode == "token":  # derendered: no ids in a stream, each event its own ``created``
        assert len({(c["id"], c["model"], c["object"]) for c in chunks}) == 1
    elif route == "completions":  # the client asked for ids: the first leg's and the next's
        assert _ids(events) == _ids(whole) and len(_ids(events)) == MAX_TOKENS
        prompts = [c.get("prompt_token_ids") for e in chunks for c in e["choices"]]
        assert prompts[0] == body["prompt"] and not any(prompts[1:])
    else:  # it did not: none shown
        assert all(c.get("token_ids") is None for e in chunks for c in e["choices"])
        assert all(e.get("prompt_token_ids") is None for e in chunks)
        assert len({e["object"] for e in chunks}) == 1
    if mode == "text":
        assert len({(c["id"], c["model"], c["created"]) for c in chunks}) == 1
    assert all(c["index"] == 0 for e in chunks for c in e["choices"])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole[-2]["usage"]
    finishes = [c["finish_reason"] for e in chunks for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["length"]
