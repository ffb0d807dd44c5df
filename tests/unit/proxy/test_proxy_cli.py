"""`vllm-pd proxy` flag, environment and file merging."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx

from tests.cli_server import cli_server, json_lines
from tests.skips import need
from tests.spans import OtlpCollector
from vllm_pd_ext.cli import build_parser
from vllm_pd_ext.proxy.cli import build_config


def test_file_env_and_flags_merge(tmp_path, monkeypatch):
    cfg_file = tmp_path / "proxy.yaml"
    cfg_file.write_text(
        "port: 9000\ninstances:\n  - {url: 'http://p:1', role: prefill}\n"
        "decision: {chars_per_token: 3.5}\n"
    )
    monkeypatch.setenv("VLLM_PD_PROXY_API_KEY", "from-env")
    args = build_parser().parse_args(
        [
            "proxy",
            "--config",
            str(cfg_file),
            "--decode",
            "http://d:2",
            "--port",
            "9100",
            "--min-split-prompt-tokens",
            "32",
            "--no-cost-model",
            "--decode-policy",
            "prefix-affinity",
        ]
    )
    config = build_config(args)
    assert config.port == 9100
    assert [(i.url, i.role) for i in config.instances] == [
        ("http://p:1", "prefill"),
        ("http://d:2", "decode"),
    ]
    assert config.api_key is not None and config.api_key.get_secret_value() == "from-env"
    assert config.decision.min_split_prompt_tokens == 32
    assert config.decision.cost_model is False
    assert config.decision.chars_per_token == 3.5
    assert config.decode_policy == "prefix-affinity"
    assert config.fast_path is True


def test_no_fast_path_flag_turns_the_fast_path_off():
    args = build_parser().parse_args(["proxy", "--decode", "http://d:2", "--no-fast-path"])
    assert build_config(args).fast_path is False


def test_the_hedge_is_on_unless_no_hedge_turns_it_off(tmp_path):
    args = build_parser().parse_args(["proxy", "--decode", "http://d:2"])
    assert build_config(args).stall_guard.hedge is True
    cfg = tmp_path / "proxy.yaml"
    cfg.write_text("stall_guard:\n  floor_s: 3.0\n")
    args = build_parser().parse_args(
        ["proxy", "--decode", "http://d:2", "--config", str(cfg), "--no-hedge"]
    )
    config = build_config(args)
    assert config.stall_guard.hedge is False and config.stall_guard.floor_s == 3.0


def test_invalid_config_exits_2_with_message():
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_pd_ext.cli", "proxy", "--decode", "not-a-url"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "invalid configuration" in proc.stderr and "http://" in proc.stderr


def test_the_proxy_logs_json_and_sends_its_traces_to_an_otlp_collector(engines, tmp_path):
    """`vllm-pd proxy --log-format json --otlp-traces-endpoint`: every line on stderr is a
    JSON object; the request's line names its request id and trace id; the collector gets
    the request's spans under that trace id (exported at the latest on shutdown)."""
    need("opentelemetry.sdk", why="the otel extra: the proxy's OTLP exporter")
    from tests.unit.proxy.helpers import LONG

    collector = OtlpCollector()
    args = ["proxy", "--prefill", engines["p1"].url, "--decode", engines["d1"].url]
    args += ["--log-format", "json", "--otlp-traces-endpoint", collector.url]
    log = tmp_path / "proxy.log"
    env = {**os.environ, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
    try:
        with cli_server(args, log, ready_within=60, env=env) as base:
            resp = httpx.post(
                f"{base}/v1/completions",
                json={"model": "fake", "prompt": LONG, "max_tokens": 3},
                timeout=30,
            )
            assert resp.status_code == 200, resp.text
            rid = resp.headers["x-request-id"]
    finally:
        collector.close()
    lines = json_lines(log)
    assert any("Application startup complete" in line["message"] for line in lines)
    (done,) = [line for line in lines if line["message"].startswith(f"request {rid} ")]
    assert done["request_id"] == rid and done["logger"] == "vllm_pd_ext.proxy.call"
    trace_id = bytes.fromhex(done["trace_id"])
    names = {s.name for s in collector.spans if s.trace_id == trace_id}
    assert {"request", "prefill", "decode"} <= names
