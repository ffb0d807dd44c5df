"""The concurrent (Mooncake-style) protocol against fake engines."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tests.unit.proxy.helpers import LONG, metric, proxy, sent, wait_until
from vllm_pd_ext.proxy.config import ProxyConfig


def mooncake_fleet(engines, prefill=("p1", "p2"), decode=("d1",)):
    return [
        {
            "url": engines[n].url,
            "role": "prefill",
            "engine_id": f"eng-{n}",
            "bootstrap_addr": f"127.0.0.1:{engines[n].port}",
        }
        for n in prefill
    ] + [{"url": engines[n].url, "role": "decode"} for n in decode]


def test_mooncake_needs_prefill_coordinates():
    with pytest.raises(ValidationError, match="engine_id and bootstrap_addr"):
        ProxyConfig(protocol="mooncake", instances=[{"url": "http://p", "role": "prefill"}])


def test_concurrent_legs_share_a_transfer_id(engines):
    with proxy(engines, protocol="mooncake", instances=mooncake_fleet(engines)) as (base, _):
        import httpx

        resp = httpx.post(
            f"{base}/v1/completions",
            timeout=60,
            headers={"X-Request-Id": "m1"},
            json={"model": "m", "prompt": LONG, "max_tokens": 4},
        )
        assert resp.status_code == 200, resp.text
        (p_body,) = sent(engines["p1"])
        d_body, rest = sent(engines["d1"])  # the KV's one token, then the answer (cached)
        tid = p_body["kv_transfer_params"]["transfer_id"]
        assert tid.startswith("pdx-")  # the proxy's request id, never the client's
        assert p_body["kv_transfer_params"] == {"do_remote_decode": True, "transfer_id": tid}
        assert d_body["kv_transfer_params"] == {
            "do_remote_prefill": True,
            "transfer_id": tid,
            "remote_engine_id": "eng-p1",
            "remote_bootstrap_addr": f"http://127.0.0.1:{engines['p1'].port}",
        }
        assert p_body["max_tokens"] == 1 and d_body["max_tokens"] == 1
        assert rest["max_tokens"] == 4 and "kv_transfer_params" not in rest
        assert engines["p1"].held_blocks == {} and engines["p1"].pulls == 1


def test_failed_prefill_cancels_its_decode_and_retries(engines):
    engines["p1"].behavior.status = 500
    with proxy(engines, protocol="mooncake", instances=mooncake_fleet(engines)) as (base, _):
        import httpx

        resp = httpx.post(
            f"{base}/v1/completions",
            timeout=60,
            json={"model": "m", "prompt": LONG, "max_tokens": 4, "stream": True},
        )
        assert resp.status_code == 200 and resp.text.rstrip().endswith("data: [DONE]")
        d_bodies = sent(engines["d1"])
        assert len(d_bodies) == 2  # one per prefill attempt
        assert d_bodies[0]["kv_transfer_params"]["remote_engine_id"] == "eng-p1"
        assert d_bodies[1]["kv_transfer_params"]["remote_engine_id"] == "eng-p2"
        wait_until(lambda: engines["d1"].disconnects == 1)  # the first decode was cancelled
        assert engines["p2"].pulls == 1
        assert metric(base, "vllm_pd_retries_total", leg="prefill") == 1
