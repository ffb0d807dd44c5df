"""The MoRI-IO (vLLM's) and pdext (ours) protocols against fake engines that check each leg's
``kv_transfer_params`` the way the connector reads them."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from pydantic import ValidationError

from tests.unit.proxy.helpers import LONG, metric, proxy, sent, wait_until
from vllm_pd_ext import fleet_key
from vllm_pd_ext.proxy.config import ProxyConfig
from vllm_pd_ext.transfer_params import VERSION, PdExtWriteDecode

BODY = {"model": "m", "prompt": LONG, "max_tokens": 4}


def coordinated_fleet(engines, prefill=("p1", "p2"), decode=("d1", "d2"), engine_ids=True):
    """Every instance with its side channel (the fake serves it on its HTTP port)."""
    return [
        {
            "url": engines[n].url,
            "role": role,
            "engine_id": f"eng-{n}" if engine_ids else None,
            "bootstrap_addr": f"127.0.0.1:{engines[n].port}",
            "notify_port": engines[n].port,
        }
        for role, names in (("prefill", prefill), ("decode", decode))
        for n in names
    ]


def play(engines, connector: str) -> None:
    for e in engines.values():
        e.behavior.connector = connector


def no_param_errors(engines) -> None:
    assert [err for e in engines.values() for err in e.param_errors] == []


def stream(base: str, body: dict) -> list[str]:
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        return [line for line in r.iter_lines() if line.startswith("data: ")]


def test_moriio_read_is_serial_and_forwards_the_prefill_answer(engines):
    play(engines, "moriio-read")
    with proxy(engines, protocol="moriio-read") as (base, _):
        events = stream(base, {**BODY, "stream": True})
    assert events[-1] == "data: [DONE]" and len(events) == 5
    (p_body,) = sent(engines["p1"])
    (d_body,) = sent(engines["d1"])
    p_params = p_body["kv_transfer_params"]
    assert set(p_params) == {"do_remote_decode", "do_remote_prefill", "transfer_id"}
    assert p_params["do_remote_decode"] is True and p_params["do_remote_prefill"] is False
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False
    # D gets P's answer verbatim: P's coordinates, block ids and the same transfer_id.
    assert d_body["kv_transfer_params"]["transfer_id"] == p_params["transfer_id"]
    assert d_body["kv_transfer_params"]["remote_handshake_port"] == engines["p1"].port
    assert d_body["max_tokens"] == 4 and d_body["stream"] is True
    assert engines["p1"].held_blocks == {} and engines["p1"].pulls == 1
    no_param_errors(engines)


def test_moriio_write_sends_both_legs_with_each_others_coordinates(engines):
    play(engines, "moriio-write")
    instances = coordinated_fleet(engines)
    with proxy(engines, protocol="moriio-write", instances=instances) as (base, _):
        resp = httpx.post(f"{base}/v1/completions", json=BODY, timeout=60)
    assert resp.status_code == 200, resp.text
    (p_body,) = sent(engines["p1"])
    d_body, rest = sent(engines["d1"])  # the KV's one token, then the answer (cached)
    assert d_body["max_tokens"] == 1 and rest == BODY
    p_params, d_params = p_body["kv_transfer_params"], d_body["kv_transfer_params"]
    tid = p_params["transfer_id"]
    assert d_params["transfer_id"] == tid and len(tid) == 32
    assert p_params == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "transfer_id": tid,
        "remote_engine_id": "eng-d1",
        "remote_block_ids": [],
        "remote_host": "127.0.0.1",
        "remote_handshake_port": engines["d1"].port,
        "remote_notify_port": engines["d1"].port,
    }
    assert d_params == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": tid,
        "remote_engine_id": "eng-p1",
        "remote_block_ids": [],
        "remote_host": "127.0.0.1",
        "remote_handshake_port": engines["p1"].port,
        "remote_notify_port": engines["p1"].port,
    }
    assert engines["p1"].pulls == 1 and engines["p1"].held_blocks == {}
    no_param_errors(engines)


def test_moriio_write_needs_every_instances_coordinates():
    with pytest.raises(ValidationError, match=r"http://d needs bootstrap_addr and notify_port"):
        ProxyConfig(
            protocol="moriio-write",
            instances=[
                {
                    "url": "http://p",
                    "role": "prefill",
                    "bootstrap_addr": "p:6301",
                    "notify_port": 1,
                },
                {"url": "http://d", "role": "decode"},
            ],
        )
    with pytest.raises(ValidationError, match="host:port"):
        ProxyConfig(instances=[{"url": "http://p", "bootstrap_addr": "p"}])


def test_write_decode_retry_elsewhere_runs_colocated(engines):
    """P pushed to d1's blocks; when d1 fails before its first byte, d2 recomputes."""
    play(engines, "moriio-write")
    engines["d1"].behavior.status = 500
    instances = coordinated_fleet(engines)
    with proxy(engines, protocol="moriio-write", instances=instances) as (base, _):
        events = stream(base, {**BODY, "stream": True})
        assert events[-1] == "data: [DONE]"
        assert "kv_transfer_params" not in sent(engines["d2"])[0]
        assert metric(base, "vllm_pd_fallbacks_total", reason="decode_retry") == 1
        assert metric(base, "vllm_pd_retries_total", leg="decode") == 1
        (prefill,) = (engines[n].url for n in ("p1", "p2") if sent(engines[n]))
        pair = {"prefill": prefill, "decode": engines["d1"].url}
        assert metric(base, "vllm_pd_split_failures_total", reason="decode_error", **pair) == 1
        assert metric(base, "vllm_pd_split_failures_total") == 1  # not d2's colocated leg
    no_param_errors(engines)


def test_pdext_read_is_the_nixl_pull_flow(engines):
    play(engines, "pdext-read")
    with proxy(engines, protocol="pdext-read") as (base, _):
        resp = httpx.post(f"{base}/v1/completions", json=BODY, timeout=60)
    assert resp.status_code == 200, resp.text
    assert "kv_transfer_params" not in resp.json()
    (p_body,) = sent(engines["p1"])
    d_body, rest = sent(engines["d1"])  # the KV's one token, then the answer (cached)
    assert d_body["max_tokens"] == 1 and rest == BODY
    assert p_body["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "transfer_mode": "read",
    }
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False
    answer = d_body["kv_transfer_params"]
    assert answer["remote_engine_id"] == "p1" and answer["transfer_mode"] == "read"
    assert engines["p1"].pulls == 1
    no_param_errors(engines)


@pytest.mark.parametrize("engine_ids", [True, False])
def test_pdext_write_legs(engines, engine_ids):
    play(engines, "pdext-write")
    instances = coordinated_fleet(engines, engine_ids=engine_ids)
    with proxy(engines, protocol="pdext-write", instances=instances) as (base, _):
        events = stream(base, {**BODY, "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1] == "data: [DONE]"
    usage = json.loads(events[-2][6:])["usage"]
    assert usage["completion_tokens"] == 4
    (p_body,) = sent(engines["p1"])
    (d_body,) = sent(engines["d1"])
    tid = p_body["kv_transfer_params"]["transfer_id"]
    assert p_body["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "transfer_mode": "write",
        "transfer_id": tid,
    }
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False
    assert "stream_options" not in p_body
    d_params = dict(d_body["kv_transfer_params"])
    assert isinstance(d_params.pop("expires_at"), float)
    assert d_params == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_mode": "write",
        "transfer_id": tid,
        "remote_engine_id": "eng-p1" if engine_ids else None,
        "remote_host": "127.0.0.1",
        "remote_port": engines["p1"].port,
        "pdext_version": VERSION,
    }
    assert d_body["stream"] is True and d_body["stream_options"] == {"include_usage": True}
    assert engines["p1"].pulls == 1 and engines["p1"].held_blocks == {}
    no_param_errors(engines)


def test_pdext_write_decode_params_are_signed_with_the_proxys_fleet_key(engines, monkeypatch):
    """A proxy holding the fleet key signs what its decode leg's connector acts on; the
    prefill leg's params stay as they were."""
    key = "ab" * 32
    monkeypatch.setenv(fleet_key.KEY_ENV, key)
    play(engines, "pdext-write")
    with proxy(engines, protocol="pdext-write", instances=coordinated_fleet(engines)) as (base, _):
        assert httpx.post(f"{base}/v1/completions", json=BODY, timeout=60).status_code == 200
    (p_body,) = sent(engines["p1"])
    d_body, _ = sent(engines["d1"])
    assert fleet_key.SIGNATURE not in p_body["kv_transfer_params"]
    params = d_body["kv_transfer_params"]
    assert fleet_key.verify(bytes.fromhex(key), params, PdExtWriteDecode.signed_fields())
    assert not fleet_key.verify(bytes.fromhex("cd" * 32), params, PdExtWriteDecode.signed_fields())
    no_param_errors(engines)


def test_pdext_write_prefill_failure_aborts_decode_then_retries_then_colocates(engines):
    play(engines, "pdext-write")
    engines["p1"].behavior.status = 500
    instances = coordinated_fleet(engines, decode=("d1",))
    with proxy(engines, protocol="pdext-write", instances=instances) as (base, _):
        resp = httpx.post(f"{base}/v1/completions", json=BODY, timeout=60)
        assert resp.status_code == 200, resp.text
        first, second, rest = sent(engines["d1"])
        assert rest == BODY  # after the KV's one token (second), the answer from D's cache
        assert first["kv_transfer_params"]["remote_port"] == engines["p1"].port
        assert second["kv_transfer_params"]["remote_port"] == engines["p2"].port
        assert (
            first["kv_transfer_params"]["transfer_id"]
            != (second["kv_transfer_params"]["transfer_id"])
        )
        wait_until(lambda: engines["d1"].disconnects == 1)  # the first decode leg was closed
        assert engines["p2"].pulls == 1
        assert metric(base, "vllm_pd_retries_total", leg="prefill") == 1

        engines["p2"].behavior.status = 503  # every prefill fails: colocated on d1
        resp = httpx.post(f"{base}/v1/completions", json=BODY, timeout=60)
        assert resp.status_code == 200
        later = sent(engines["d1"])[3:]  # a closed leg may be recorded after the colocated one
        assert len([b for b in later if "kv_transfer_params" not in b]) == 1

        def split_legs() -> list[str]:
            legs = sent(engines["d1"])[3:]
            return [
                b["kv_transfer_params"]["transfer_id"] for b in legs if "kv_transfer_params" in b
            ]

        # every split decode leg that reached d1 was closed while it waited for the KV (one
        # cancelled before it was sent never arrives)
        waits = engines["d1"].kv_waits
        wait_until(lambda: all(tid in waits for tid in split_legs()))
        split = split_legs()
        assert [waits[tid] for tid in split] == ["gone"] * len(split)
        assert engines["d1"].disconnects == 1 + len(split)
        assert metric(base, "vllm_pd_fallbacks_total", reason="prefill_failed") == 1
    no_param_errors(engines)


def test_pdext_write_client_gone_during_prefill_aborts_both_legs(engines):
    play(engines, "pdext-write")
    engines["p1"].behavior.delay_s = 5
    instances = coordinated_fleet(engines, prefill=("p1",), decode=("d1",))
    with proxy(engines, protocol="pdext-write", instances=instances) as (base, svc):

        async def go():
            async with httpx.AsyncClient(timeout=60) as client:
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(client.post(f"{base}/v1/completions", json=BODY), 0.5)

        asyncio.run(go())
        wait_until(lambda: engines["p1"].disconnects == 1 and engines["d1"].disconnects == 1)
        wait_until(lambda: svc.admission.in_flight == 0)
        assert metric(base, "vllm_pd_aborts_total", phase="prefill") == 1
        assert engines["p1"].held_blocks == {}


def test_watched_prefill_without_side_channel_serves_colocated(engines, tmp_path):
    """A dynamic fleet is not validated up front: a prefill missing its side channel is a
    failed prefill leg, not a 500."""
    path = tmp_path / "fleet.json"
    fleet = [
        {"url": engines["p1"].url, "role": "prefill"},
        {"url": engines["d1"].url, "role": "decode"},
    ]
    path.write_text(json.dumps({"instances": fleet}))
    with proxy(engines, protocol="pdext-write", instances=[], instances_file=str(path)) as (
        base,
        _,
    ):
        resp = httpx.post(f"{base}/v1/completions", json=BODY, timeout=60)
        assert resp.status_code == 200
        assert not engines["p1"].requests
        assert "kv_transfer_params" not in sent(engines["d1"])[0]
        assert metric(base, "vllm_pd_fallbacks_total", reason="prefill_failed") == 1
