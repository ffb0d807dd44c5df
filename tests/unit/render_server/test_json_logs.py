"""`vllm-pd render --log-format json`: every line a JSON object (uvicorn's too), a request's
lines with its request id and the trace id of the proxy's ``traceparent``."""

from __future__ import annotations

import httpx

from tests.cli_server import cli_server, json_lines

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def test_the_render_server_logs_json_with_the_request_and_trace_ids(tiny_llama, tmp_path):
    args = ["render", str(tiny_llama), "--log-format", "json", "--log-level", "debug"]
    log = tmp_path / "render.log"
    with cli_server(args, log, ready_within=120) as base:
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
    lines = json_lines(log)
    assert any("Application startup complete" in line["message"] for line in lines)
    served = [line for line in lines if line["message"].startswith("completion_render: ")]
    assert [(line["message"].split(" in ")[0], line.get("request_id")) for line in served] == [
        ("completion_render: HTTP 200", "pdx-r1"),
        ("completion_render: HTTP 400", None),
    ]
    assert served[0]["trace_id"] == TRACE and "trace_id" not in served[1]
