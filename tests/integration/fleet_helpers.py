"""Integration helpers: a NIXL P/D pair of real `vllm serve`, a `vllm-pd proxy` subprocess,
a whole `vllm-pd up` stack, and waiting for engines to return to idle."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from tests.cli_server import cli_server
from vllm_pd_ext import fleet_key
from vllm_pd_ext.tools.pd_demo import (
    NIXL_CPU,
    completion_body,
    make_prompt_ids,
    prefill_leg,
    stream_completion,
)
from vllm_pd_ext.transfer_params import WRITE, PdExtWriteDecode, PrefillLeg
from vllm_pd_ext.util.vllm_process import VllmServer, free_port

#: The fleet key of every pdext pair and every proxy these tests start.
FLEET_KEY = secrets.token_hex(fleet_key.MIN_KEY_BYTES)


def wait_whole_fleet(proxy_url: str, prefill: int = 1, decode: int = 1, timeout=120.0) -> None:
    """Until the proxy at ``proxy_url`` sees ``prefill`` prefill and ``decode`` decode instances
    healthy."""
    deadline = time.monotonic() + timeout
    doc: dict = {}
    while doc.get("healthy_prefill") != prefill or doc.get("healthy_decode") != decode:
        assert time.monotonic() < deadline, doc
        time.sleep(0.2)
        with contextlib.suppress(httpx.HTTPError, ValueError):
            doc = httpx.get(f"{proxy_url}/health", timeout=5).json()


def stream_token_ids(url: str, body: dict) -> list[int]:
    """The token ids of a streamed completion of ``body`` (with return_token_ids) at ``url``;
    asserts a 200 and no error event."""
    ids: list[int] = []
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120
    ) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                for choice in chunk["choices"]:
                    ids.extend(choice.get("token_ids") or [])
    return ids


def nixl_pair(
    vllm_servers, model: Path, prefix: str, extra_config: dict | None = None
) -> tuple[VllmServer, VllmServer]:
    """A healthy prefill (core 0) and decode (core 1) with NixlConnector on CPU, prefix
    caching off so every split shows up as an external KV load."""
    kv: dict[str, Any] = {**NIXL_CPU}
    if extra_config:
        kv["kv_connector_extra_config"] = extra_config
    servers = [
        vllm_servers.start(
            model,
            name=f"{prefix}-{role}",
            wait=False,
            cpu_core=core,
            kv_transfer_config=kv,
            env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
            extra_args=["--no-enable-prefix-caching"],
        )
        for role, core in (("prefill", 0), ("decode", 1))
    ]
    for server in servers:
        server.wait_healthy()
    for server in servers:  # NIXL's progress thread polls without pause: see util/busy_threads
        server.calm_idle_pollers()
    warm_up_split(servers[0], servers[1], model)
    return servers[0], servers[1]


def warm_up_split(prefill: VllmServer, decode: VllmServer, model: Path, attempts: int = 3) -> None:
    """One throwaway split request, retried: a NIXL pair's first request pays the handshake,
    which can time out when the host's cores are busy (vLLM then fails that one request).
    Tests measure later requests, over the established connection."""
    prompt_ids = make_prompt_ids(model, 64)
    for attempt in range(attempts):
        with httpx.Client(timeout=httpx.Timeout(120.0, connect=5.0)) as client:
            try:
                body = {**completion_body(prefill, prompt_ids, 2), "stream": False}
                body.pop("stream_options", None)
                params, _ = prefill_leg(client, prefill, body)
                decode_body = {
                    **completion_body(decode, prompt_ids, 2),
                    "kv_transfer_params": params,
                }
                stream_completion(client, decode, decode_body)
                return
            except (RuntimeError, httpx.HTTPError):
                if attempt == attempts - 1:
                    raise
                time.sleep(2)


def wait_idle(server: VllmServer, timeout: float = 60.0) -> None:
    """Wait until the engine runs no request and holds no KV blocks."""
    deadline = time.monotonic() + timeout
    while True:
        running = server.metric("vllm:num_requests_running")
        usage = server.metric("vllm:kv_cache_usage_perc")
        if running == 0 and usage == 0:
            return
        assert time.monotonic() < deadline, (server.base_url, running, usage)
        time.sleep(0.5)


@contextlib.contextmanager
def running_proxy(args: list[str], log: Path, ready_timeout: float = 60) -> Iterator[str]:
    """Start the proxy with ``args`` and ``FLEET_KEY``, wait for ``/health`` 200, yield its
    URL, stop it.

    On exit asserts the proxy shut down cleanly on SIGTERM.
    """
    env = {**os.environ, fleet_key.KEY_ENV: FLEET_KEY}
    with cli_server(["proxy", *args], log, ready_within=ready_timeout, env=env) as url:
        yield url


@dataclass
class UpStack:
    """A `vllm-pd up` that said it is ready."""

    #: The proxy's base URL (``/v1`` is under it).
    proxy: str
    #: Everything up wrote until it was ready, its banner last.
    banner: str
    #: Each engine and render server's URL by its name in the banner (``decode-0``, ...).
    parts: dict[str, str]
    #: The served model name.
    model: str
    #: The processes up had started by then: engines, their workers, render servers, proxy.
    children: list[psutil.Process]


@contextlib.contextmanager
def running_up(
    args: list[str], tmp: Path, model_cache: Path, ready_within: float = 420
) -> Iterator[UpStack]:
    """Run ``vllm-pd up <args>`` on a free port (its logs under ``tmp/logs``, its output in
    ``tmp/up.out``), tiny models from ``model_cache``; yield it once it printed ``ready:``.

    On leaving without an error, stops it with SIGINT, as Ctrl-C would, and asserts it exited
    0, said it stopped everything it started, and that every process it had started is gone.
    On any exit, kills its process group if it still runs."""
    port = free_port()
    out_path = tmp / "up.out"
    argv = [sys.executable, "-m", "vllm_pd_ext.cli", "up", *args]
    argv += ["--port", str(port), "--log-dir", str(tmp / "logs")]
    env = {**os.environ, "VLLM_PD_EXT_CACHE": str(model_cache)}
    with open(out_path, "wb") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        deadline = time.monotonic() + ready_within
        while "ready:" not in out_path.read_text():
            assert proc.poll() is None, out_path.read_text()
            assert time.monotonic() < deadline, out_path.read_text()
            time.sleep(1)
        banner = out_path.read_text()
        found = re.search(r"\(model '([^']+)'", banner)
        assert found, banner
        children = psutil.Process(proc.pid).children(recursive=True)
        yield UpStack(
            proxy=f"http://127.0.0.1:{port}",
            banner=banner,
            parts=dict(re.findall(r"^  (\S+): (http://\S+)$", banner, re.M)),
            model=found.group(1),
            children=children,
        )
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 0, out_path.read_text()[-3000:]
        assert "stopped everything it started" in out_path.read_text()
        _, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, [p.pid for p in alive]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # its children get SIGTERM (PDEATHSIG)


def split_write(client, prefill, decode, side, prompt_ids, max_tokens, prefill_ids=None):
    """Both legs at once, as the proxy's pdext-write protocol sends them (the decode leg's
    params signed with ``FLEET_KEY``); ``prefill_ids``: the prefill leg's prompt, when it is
    to differ from the decode leg's."""
    tid = uuid.uuid4().hex
    p_body = {
        **completion_body(prefill, prompt_ids if prefill_ids is None else prefill_ids, 1),
        "stream": False,
        "kv_transfer_params": PrefillLeg(transfer_mode=WRITE, transfer_id=tid).params(),
    }
    p_body.pop("stream_options", None)
    d_params = PdExtWriteDecode.build(tid, None, "127.0.0.1", side)
    d_body = {
        **completion_body(decode, prompt_ids, max_tokens),
        "kv_transfer_params": d_params.signed(bytes.fromhex(FLEET_KEY)),
    }
    result: dict[str, Any] = {}
    leg = threading.Thread(
        target=lambda: result.setdefault(
            "p", client.post(f"{prefill.base_url}/v1/completions", json=p_body)
        )
    )
    leg.start()
    ids, _ = stream_completion(client, decode, d_body)
    leg.join(timeout=120)
    assert result["p"].status_code == 200, result["p"].text
    return ids


def pdext_connector(
    role: str, side_port: int, backend: str = "mooncake", lease_s: float = 8.0, **extra: Any
) -> dict:
    """kv-transfer-config of a PdExtMoRIIOConnector engine on 127.0.0.1 (CPU); ``extra``:
    more ``kv_connector_extra_config`` keys."""
    settings = {"protocol": "tcp", "host": "127.0.0.1"} if backend == "mooncake" else {}
    return {
        "kv_connector": "PdExtMoRIIOConnector",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "backend": backend,
            "backend_settings": {**settings, "host": "127.0.0.1"},
            "side_channel_host": "127.0.0.1",
            "side_channel_port": side_port,
            "lease_s": lease_s,
            **extra,
        },
    }


def pdext_pair(
    vllm_servers,
    model,
    name: str,
    backend: str = "mooncake",
    lease_s: float = 8.0,
    tp: int = 1,
    env: dict[str, str] | None = None,
    extra_args: list[str] | None = None,
    decode_tp: int | None = None,
    **extra: Any,
):
    """A healthy PdExtMoRIIOConnector prefill (core 0) and decode (core 1), prefix caching off;
    returns (prefill, decode, prefill side-channel port). Both hold ``FLEET_KEY``: the prefill
    signs its answers, the decode loads only what is signed. ``tp`` > 1: both engines at that
    tensor parallel size, rank i of each on core i (the engines share the cores), each with
    ``tp`` side-channel ports from the one given; ``decode_tp``: the decode engine's TP size
    when it differs (``tp`` is then the prefill's); ``env``, ``extra_args``: more of both
    engines' environment and `vllm serve` arguments; ``extra``: more connector config keys."""
    side = free_port() if tp == 1 else free_port_run(tp)
    servers = [
        vllm_servers.start(
            model,
            name=f"{name}-{role}",
            wait=False,
            cpu_core=core if size == 1 else range(size),
            kv_transfer_config=pdext_connector(kv_role, port, backend, lease_s, **extra),
            extra_args=[
                "--no-enable-prefix-caching",
                *(["--tensor-parallel-size", str(size)] if size > 1 else []),
                *(extra_args or ()),
            ],
            env={fleet_key.KEY_ENV: FLEET_KEY, **(env or {})},
        )
        for role, kv_role, core, port, size in (
            ("prefill", "kv_producer", 0, side, tp),
            ("decode", "kv_consumer", 1, free_port(), tp if decode_tp is None else decode_tp),
        )
    ]
    for server in servers:
        server.wait_healthy()
    return servers[0], servers[1], side


def free_port_run(n: int, attempts: int = 64) -> int:
    """The first of ``n`` consecutive ports that were free a moment ago (a TP engine's side
    channel takes one per rank)."""
    for _ in range(attempts):
        first = free_port()
        if all(port_is_free(first + i) for i in range(1, n)):
            return first
    raise RuntimeError(f"no {n} consecutive free ports found")


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def split_read(client, prefill, decode, prompt_ids, max_tokens):
    """Serial legs, as the proxy's pdext-read protocol sends them; returns decode's token ids."""
    body = completion_body(prefill, prompt_ids, max_tokens)
    params, _ = prefill_leg(client, prefill, body)
    assert params["protocol"] == "pdext" and params["transfer_mode"] == "read"
    ids, _ = stream_completion(
        client,
        decode,
        {**completion_body(decode, prompt_ids, max_tokens), "kv_transfer_params": params},
    )
    return ids


def run_doctor(prefill: VllmServer, decode: VllmServer, prompts: int = 2, tokens: int = 300):
    """`vllm-pd doctor --json` against a running pair; its parsed report."""
    argv = [sys.executable, "-m", "vllm_pd_ext.cli", "doctor", "--prefill", prefill.base_url,
            "--decode", decode.base_url, "--prompts", str(prompts), "--prompt-tokens",
            str(tokens), "--json"]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


class Trap:
    """A listener on 127.0.0.1 that counts the connections it is offered (and closes them)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()
