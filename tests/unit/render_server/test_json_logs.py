"""`vllm-pd render --log-format json`: every line a JSON object (uvicorn's too), a request's
lines with its request id and the trace id of the proxy's ``traceparent``."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time

import httpx

from vllm_pd_ext.util.vllm_process import free_port

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def test_the_render_server_logs_json_with_the_request_and_trace_ids(tiny_llama, tmp_path):
    port = free_port()
    argv = [sys.executable, "-m", "vllm_pd_ext.cli", "render", str(tiny_llama)]
    argv += ["--port", str(port), "--log-format", "json", "--log-level", "debug"]
    log = tmp_path / "render.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        headers = {"X-Request-Id": "pdx-r1", "traceparent": f"00-{TRACE}-00f067aa0ba902b7-01"}
        resp = httpx.post(
            f"{base}/v1/completions/render",
            json={"model": str(tiny_llama), "prompt": "hello there"},
            headers=headers,
            timeout=30,
        )
        assert resp.status_code == 200, resp.text
        untraced = httpx.post(f"{base}/v1/completions/render", json={"prompt": 5}, timeout=30)
        assert untraced.status_code == 400
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    assert any("Application startup complete" in line["message"] for line in lines)
    served = [line for line in lines if line["message"].startswith("completion_render: ")]
    assert [(line["message"].split(" in ")[0], line.get("request_id")) for line in served] == [
        ("completion_render: HTTP 200", "pdx-r1"),
        ("completion_render: HTTP 400", None),
    ]
    assert served[0]["trace_id"] == TRACE and "trace_id" not in served[1]
