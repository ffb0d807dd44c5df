"""Run `vllm-pd proxy` as a real subprocess for integration tests."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from vllm_pd_ext.tools.vllm_process import free_port


@contextlib.contextmanager
def running_proxy(args: list[str], log: Path, ready_timeout: float = 60) -> Iterator[str]:
    """Start the proxy with ``args``, wait for ``/health`` 200, yield its URL, stop it.

    On exit asserts the proxy shut down cleanly on SIGTERM.
    """
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm_pd_ext.cli", "proxy", "--port", str(port), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            assert proc.poll() is None, log.read_text()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
    # uvicorn re-raises SIGTERM once it has shut down cleanly.
    assert proc.returncode in (0, -15), log.read_text()[-4000:]
    assert "Application shutdown complete" in log.read_text()
