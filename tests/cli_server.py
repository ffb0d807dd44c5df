"""A ``vllm-pd`` server command (``proxy``, ``render``) run as a child process on a free
loopback port, its stdout and stderr in one log file, and that log read back as JSON lines
(``--log-format json``). The unit tests and the integration tests share it."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx

from vllm_pd_ext.util.vllm_process import free_port


@contextlib.contextmanager
def cli_server(
    args: list[str], log: Path, *, ready_within: float, env: Mapping[str, str] | None = None
) -> Iterator[str]:
    """Start ``vllm-pd <args> --port <free port>`` in a session of its own, writing to
    ``log``; yield its base URL once ``/health`` answers 200. Fails with the log if the
    process exits or is not healthy within ``ready_within`` seconds.

    On leaving, sends SIGTERM (SIGKILL after 20 s); when the body raised nothing, asserts
    the server shut down cleanly (uvicorn re-raises SIGTERM once it has)."""
    port = free_port()
    argv = [sys.executable, "-m", "vllm_pd_ext.cli", *args, "--port", str(port)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_within
        while True:
            assert proc.poll() is None, log.read_text()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
    assert proc.returncode in (0, -15), log.read_text()[-4000:]
    assert "Application shutdown complete" in log.read_text()


def json_lines(log: Path) -> list[dict[str, Any]]:
    """Every non-blank line of ``log``, each parsed as a JSON object (any other line fails)."""
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
