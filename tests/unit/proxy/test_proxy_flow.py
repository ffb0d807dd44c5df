"""The proxy end to end against fake engines on loopback: legs, failures, disconnects, limits."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest

from tests.unit.proxy.helpers import LONG, SHORT, fleet, metric, proxy, sent, wait_until
from vllm_pd_ext.proxy import client_channel
from vllm_pd_ext.proxy.service import ProxyService


def test_split_non_streaming_legs_and_response(engines):
    with proxy(engines) as (base, _):
        body = {
            "model": "m",
            "prompt": LONG,
            "max_tokens": 5,
            "min_tokens": 2,
            "stream_options": {"include_usage": True},
            "temperature": 0,
        }
        resp = httpx.post(
            f"{base}/v1/completions", json=body, headers={"X-Request-Id": "req-42"}, timeout=60
        )
    assert resp.status_code == 200, resp.text
    data = resp.json()
    assert "kv_transfer_params" not in data
    assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == 3  # from the prefill side
    (p_req,) = engines["p1"].requests
    d_req, rest = engines["d1"].requests  # the KV's one token, then the answer (cached)
    p_body, d_body = p_req["body"], d_req["body"]
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False
    assert "min_tokens" not in p_body and "stream_options" not in p_body
    assert p_body["kv_transfer_params"]["do_remote_decode"] is True
    assert d_body == {**p_body, "kv_transfer_params": d_body["kv_transfer_params"]}
    assert d_body["kv_transfer_params"]["remote_engine_id"] == "p1"
    assert rest["body"] == body
    # the engines see the proxy's own id for every leg; the client gets its own id back
    engine_id = p_req["headers"]["x-request-id"]
    assert engine_id.startswith("pdx-")
    assert d_req["headers"]["x-request-id"] == rest["headers"]["x-request-id"] == engine_id
    assert resp.headers["x-request-id"] == "req-42"
    assert engines["p1"].held_blocks == {}  # the decode side pulled them


def test_split_streaming_chat_relays_events_and_counts(engines):
    with proxy(engines) as (base, _):
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": LONG}],
            "max_tokens": 6,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        text = "".join(c["choices"][0]["delta"]["content"] for c in chunks if c["choices"])
        assert len(text.split()) == 6
        usage = chunks[-1]["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 3
        assert "kv_transfer_params" not in chunks[-1]
        assert metric(base, "vllm_pd_ttft_seconds_count", decision="split") == 1
        assert metric(base, "vllm_pd_transfer_gap_seconds_count") == 1
        assert metric(base, "vllm_pd_requests_total", decision="split", outcome="ok") == 1
        assert metric(base, "vllm_pd_in_flight") == 0


def test_short_prompt_is_served_colocated(engines):
    with proxy(engines) as (base, _):
        resp = httpx.post(
            f"{base}/v1/completions",
            json={"model": "m", "prompt": SHORT, "max_tokens": 3},
            timeout=60,
        )
        assert resp.status_code == 200
        assert not engines["p1"].requests and not engines["p2"].requests
        (d_body,) = sent(engines["d1"])
        assert "kv_transfer_params" not in d_body
        assert (
            metric(base, "vllm_pd_decisions_total", decision="colocated", reason="short_prompt")
            == 1
        )


def test_pass_through_sends_the_client_body_bytes_unchanged(engines):
    raw = b'{"model": "m",  "prompt": "hi there", "max_tokens": 2, "temperature": 1.0}'
    with proxy(engines) as (base, _):
        resp = httpx.post(
            f"{base}/v1/completions",
            content=raw,
            headers={"content-type": "application/json"},
            timeout=60,
        )
        assert resp.status_code == 200
        assert engines["d1"].requests[0]["raw"] == raw


def test_client_kv_transfer_params_dropped_or_rejected(engines):
    evil = {"do_remote_prefill": True, "remote_host": "10.0.0.9", "remote_port": 1}
    with proxy(engines) as (base, _):
        resp = httpx.post(
            f"{base}/v1/completions",
            timeout=60,
            json={"model": "m", "prompt": SHORT, "max_tokens": 2, "kv_transfer_params": evil},
        )
        assert resp.status_code == 200
        assert "kv_transfer_params" not in sent(engines["d1"])[0]
    with proxy(engines, client_kv_transfer_params="reject") as (base, _):
        resp = httpx.post(
            f"{base}/v1/completions",
            timeout=60,
            json={"model": "m", "prompt": SHORT, "kv_transfer_params": evil},
        )
        assert resp.status_code == 400
        assert resp.json()["error"]["param"] == "kv_transfer_params"


@pytest.mark.parametrize(
    "steer",
    [
        {"ec_transfer_params": {"do_remote_decode": True}},
        {"vllm_xargs": {"kv_transfer_params": {"do_remote_prefill": True}, "mine": "kept"}},
        {"vllm_xargs": {"ec_transfer_params": "x", "mine": "kept"}},
    ],
    ids=["ec_transfer_params", "vllm_xargs.kv_transfer_params", "vllm_xargs.ec_transfer_params"],
)
def test_every_field_that_steers_a_connector_is_dropped_or_rejected(engines, steer):
    """vLLM hands the connectors kv/ec_transfer_params from the top level and from
    vllm_xargs (copied into extra_args): none of them gets past the proxy from a client."""
    body = {"model": "m", "prompt": SHORT, "max_tokens": 2, **steer}
    with proxy(engines) as (base, _):
        resp = httpx.post(f"{base}/v1/completions", timeout=60, json=body)
        assert resp.status_code == 200
        (got,) = sent(engines["d1"]) + sent(engines["d2"])
        assert "ec_transfer_params" not in got and "kv_transfer_params" not in got
        assert got.get("vllm_xargs") in (None, {"mine": "kept"})
    with proxy(engines, client_kv_transfer_params="reject") as (base, _):
        resp = httpx.post(f"{base}/v1/completions", timeout=60, json=body)
        assert resp.status_code == 400
        name = next(iter(steer))
        inner = (
            [k for k in steer[name] if k.endswith("_transfer_params")]
            if name == "vllm_xargs"
            else []
        )
        assert resp.json()["error"]["param"] == ".".join([name, *inner])


#: vLLM's request-validation type for a body that is not JSON or misses the schema, and the
#: type of its own checks on a valid body.
SCHEMA, OWN = "Bad Request", "BadRequestError"


@pytest.mark.parametrize(
    ("content", "status", "fragment", "type_", "param"),
    [
        (b"{not json", 400, "not valid JSON", SCHEMA, "body"),
        (b'{"prompt": ' + b"[" * 3000, 400, "not valid JSON", SCHEMA, "body"),  # too deep
        (b"[1, 2]", 400, "JSON object", SCHEMA, "body"),
        (b'{"prompt": "x", "max_tokens": "ten"}', 400, "'max_tokens'", SCHEMA, "body.max_tokens"),
        (b'{"prompt": "x", "stream": "yes"}', 400, "'stream'", SCHEMA, "body.stream"),
        # several wrong: the first of the checked fields, whatever the body's order
        (b'{"prompt": "x", "n": "2", "model": 5}', 400, "'model'", SCHEMA, "body.model"),
        (
            b'{"prompt": "x", "max_tokens": -1}',
            400,
            "non-negative",
            "BadRequestError",
            "max_tokens",
        ),
        (b'{"prompt": null}', 400, "'prompt'", SCHEMA, "body.prompt"),
        (json.dumps({"prompt": "x" * 5000}).encode(), 413, "exceeds", OWN, None),
    ],
)
def test_bad_bodies_get_openai_errors(engines, content, status, fragment, type_, param):
    with proxy(engines, max_body_bytes=4096) as (base, _):
        resp = httpx.post(
            f"{base}/v1/completions",
            content=content,
            headers={"content-type": "application/json"},
            timeout=60,
        )
    assert resp.status_code == status
    err = resp.json()["error"]
    assert fragment in err["message"]
    assert (err["type"], err["param"]) == (type_, param)
    assert not any(e.requests for e in engines.values())


def test_oversized_chunked_body_is_413_and_the_connection_serves_on(engines):
    """No Content-Length: the body is cut past the limit as it arrives, then refused."""

    def pieces():
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}'

    with proxy(engines, max_body_bytes=4096) as (base, _), httpx.Client(timeout=60) as client:
        resp = client.post(f"{base}/v1/completions", content=pieces())
        assert resp.status_code == 413 and "exceeds" in resp.json()["error"]["message"]
        again = client.post(f"{base}/v1/completions", json={"model": "m", "prompt": SHORT})
        assert again.status_code == 200
    assert len([r for e in engines.values() for r in e.requests]) == 1


def test_chat_without_messages_and_engine_4xx_pass_through(engines):
    with proxy(engines) as (base, _):
        resp = httpx.post(f"{base}/v1/chat/completions", json={"model": "m"}, timeout=60)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "body.messages"
        resp = httpx.post(
            f"{base}/v1/completions", timeout=60, json={"model": "bad", "prompt": LONG}
        )
        assert resp.status_code == 404
        assert "does not exist" in resp.json()["error"]["message"]


def test_prefill_error_retries_then_falls_back_colocated(engines):
    engines["p1"].behavior.status = 500
    with proxy(engines) as (base, _):
        resp = httpx.post(
            f"{base}/v1/completions",
            timeout=60,
            json={"model": "m", "prompt": LONG, "max_tokens": 2},
        )
        assert resp.status_code == 200
        assert len(engines["p1"].requests) == 1 and len(engines["p2"].requests) == 1
        assert sent(engines["d1"])[0]["kv_transfer_params"]["remote_engine_id"] == "p2"
        assert metric(base, "vllm_pd_retries_total", leg="prefill") == 1

        engines["p2"].behavior.status = 503
        resp = httpx.post(
            f"{base}/v1/completions",
            timeout=60,
            json={"model": "m", "prompt": LONG, "max_tokens": 2},
        )
        assert resp.status_code == 200
        last_decode = (engines["d1"].requests + engines["d2"].requests)[-1]["body"]
        assert "kv_transfer_params" not in last_decode
        assert metric(base, "vllm_pd_fallbacks_total", reason="prefill_failed") == 1


def test_prefill_failure_can_fail_the_request(engines):
    engines["p1"].behavior.omit_kv_params = True
    engines["p2"].behavior.status = 500
    with proxy(engines, on_prefill_failure="retry-then-fail") as (base, _):
        resp = httpx.post(f"{base}/v1/completions", timeout=60, json={"model": "m", "prompt": LONG})
    assert resp.status_code == 502
    assert "no kv_transfer_params" in resp.json()["error"]["message"]
    assert not engines["d1"].requests and not engines["d2"].requests


def test_unreachable_prefill_is_marked_down_and_skipped(engines):
    dead = "http://127.0.0.1:9"  # discard port: nothing listens
    instances = [{"url": dead, "role": "prefill"}, *fleet(engines, prefill=("p1",))]
    with proxy(engines, instances=instances, prefill_policy="least-loaded") as (base, svc):
        assert {i.url: i.healthy for i in svc.fleet.instances()}[dead] is False
        resp = httpx.post(
            f"{base}/v1/completions",
            timeout=60,
            json={"model": "m", "prompt": LONG, "max_tokens": 2},
        )
        assert resp.status_code == 200
        assert len(engines["p1"].requests) == 1
        assert metric(base, "vllm_pd_upstream_healthy", instance=dead) == 0


def test_decode_error_before_first_byte_retries_other_decode(engines):
    engines["d1"].behavior.status = 500
    with proxy(engines) as (base, _):
        resp = httpx.post(
            f"{base}/v1/completions",
            timeout=60,
            json={"model": "m", "prompt": SHORT, "max_tokens": 2, "stream": True},
        )
        assert resp.status_code == 200 and resp.text.rstrip().endswith("data: [DONE]")
        assert len(engines["d2"].requests) == 1
        assert metric(base, "vllm_pd_retries_total", leg="decode") == 1


def _stream_events(base: str, max_tokens: int, prompt: str = SHORT) -> list[str]:
    """The ``data:`` lines of a streamed completion (of the short prompt: colocated)."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", timeout=60, json=body) as r:
        assert r.status_code == 200
        return [line for line in r.iter_lines() if line.startswith("data: ")]


COLOCATED = {"min_split_prompt_tokens": 1 << 30, "cost_model": False}  # never split


def _colocated_stream(engines, instances: list[dict]) -> list[str]:
    """The events of a long prompt's stream served colocated over ``instances`` (what a
    split's stream must equal); every engine's request record cleared after it."""
    with proxy(engines, instances=instances, decision=COLOCATED) as (base, _):
        expected = _stream_events(base, 5, LONG)
    for e in engines.values():
        e.requests.clear()
    return expected


def test_decode_dying_mid_stream_ends_with_one_error_event_when_migration_is_off(engines):
    for d in ("d1", "d2"):
        engines[d].behavior.die_after_tokens = 2
    with proxy(engines, max_migrations=0) as (base, _):
        events = _stream_events(base, 8)
        assert len(events) == 3
        assert json.loads(events[-1][6:])["error"]["code"] == 502
        assert metric(base, "vllm_pd_requests_total", outcome="decode_failed_mid_stream") == 1
        assert metric(base, "vllm_pd_in_flight") == 0


def test_decode_going_silent_mid_stream_ends_with_one_error_event_and_no_retry(engines):
    """The read timeout fires while the stream flows from the engine connection (no task
    woken since the head): with migration off, still one error event after the tokens,
    never a second engine's answer appended to the first's."""
    for d in ("d1", "d2"):
        engines[d].behavior.token_delay_s = 30.0
    timeouts = {"decode_first_byte_s": 2.0, "decode_idle_s": 2.0}
    with proxy(engines, timeouts=timeouts, max_migrations=0) as (base, _):
        events = _stream_events(base, 4)
        assert len(events) == 2
        assert json.loads(events[-1][6:])["error"]["code"] == 502
        assert len(engines["d1"].requests) + len(engines["d2"].requests) == 1
        assert metric(base, "vllm_pd_requests_total", outcome="decode_failed_mid_stream") == 1
        assert metric(base, "vllm_pd_retries_total", leg="decode") == 0
        assert metric(base, "vllm_pd_in_flight") == 0


def _disconnect_after(base: str, body: dict, seconds: float, path="/v1/completions") -> None:
    async def go():
        async with httpx.AsyncClient(timeout=60) as client:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(client.post(f"{base}{path}", json=body), seconds)

    asyncio.run(go())


def test_disconnect_while_waiting_for_prefill_cancels_it(engines):
    for p in ("p1", "p2"):
        engines[p].behavior.delay_s = 5
    with proxy(engines) as (base, svc):
        _disconnect_after(base, {"model": "m", "prompt": LONG}, 0.5)
        wait_until(lambda: engines["p1"].disconnects + engines["p2"].disconnects == 1)
        wait_until(lambda: svc.admission.in_flight == 0)
        assert metric(base, "vllm_pd_aborts_total", phase="prefill") == 1
        assert not engines["d1"].requests and not engines["d2"].requests
        assert engines["p1"].held_blocks == {} and engines["p2"].held_blocks == {}


def test_disconnect_between_legs_drains_prefill_kv(engines, monkeypatch):
    """The client leaves once the prefill has answered (its KV held), before the decode leg
    is sent: a one-token drain (without the client's min_tokens, which an engine refuses
    above max_tokens) lets the decode side pull the KV, so the prefill side frees it now."""
    from vllm_pd_ext.proxy.prefill import PrefillLeg

    real = PrefillLeg.run

    async def run_then_wait_for_the_client_to_leave(self, call, route):
        prefilled = await real(self, call, route)
        await asyncio.wait_for(call.watch.gone.wait(), 30)
        return prefilled

    monkeypatch.setattr(PrefillLeg, "run", run_then_wait_for_the_client_to_leave)
    body = {"model": "m", "prompt": LONG, "max_tokens": 50, "min_tokens": 5}
    with proxy(engines) as (base, svc):

        async def leave_once_the_prefill_holds_kv():
            async with httpx.AsyncClient(timeout=60) as client:
                post = asyncio.ensure_future(client.post(f"{base}/v1/completions", json=body))
                deadline = time.monotonic() + 30
                while not engines["p1"].held_blocks and not engines["p2"].held_blocks:
                    assert time.monotonic() < deadline and not post.done()
                    await asyncio.sleep(0.01)
                post.cancel()
                await asyncio.gather(post, return_exceptions=True)

        asyncio.run(leave_once_the_prefill_holds_kv())
        wait_until(lambda: metric(base, "vllm_pd_drains_total") == 1)
        assert metric(base, "vllm_pd_drains_total", outcome="ok") == 1
        assert engines["p1"].held_blocks == {} and engines["p2"].held_blocks == {}
        assert engines["p1"].pulls + engines["p2"].pulls == 1
        drain = (engines["d1"].requests + engines["d2"].requests)[-1]
        assert drain["body"]["max_tokens"] == 1 and "min_tokens" not in drain["body"]
        assert drain["headers"]["x-request-id"].endswith("-drain")
        assert metric(base, "vllm_pd_aborts_total", phase="between_legs") == 1
        wait_until(lambda: not svc.background.tasks and svc.admission.in_flight == 0)


def test_disconnect_while_streaming_aborts_decode(engines):
    for d in ("d1", "d2"):
        engines[d].behavior.token_delay_s = 0.2
    with proxy(engines) as (base, svc):

        async def go():
            async with httpx.AsyncClient(timeout=60) as client:
                body = {"model": "m", "prompt": SHORT, "max_tokens": 50, "stream": True}
                async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
                    async for _ in r.aiter_lines():
                        break

        asyncio.run(go())
        wait_until(lambda: engines["d1"].disconnects + engines["d2"].disconnects == 1)
        wait_until(lambda: svc.admission.in_flight == 0)
        assert metric(base, "vllm_pd_aborts_total", phase="decode_stream") == 1
        assert metric(base, "vllm_pd_requests_total", outcome="client_gone") == 1
        assert metric(base, "vllm_pd_requests_total", decision="colocated") == 1
        assert engines["d1"].running == 0 and engines["d2"].running == 0


def test_pass_through_stream_events_go_straight_to_the_client_in_order(
    engines, monkeypatch, server_path
):
    """On the fast path, once the head is out, the events between the first and the last
    are written to the client from the engine connection's data_received (DirectWriter), in
    order, each timed; the disconnect watch is the protocol itself, no watcher task. On the
    plain path every event goes through the ASGI send, watched by a watcher task."""
    from vllm_pd_ext.proxy import front_protocol

    direct: list[bytes] = []
    real_write = front_protocol.DirectWriter.write

    def write(self, data):
        direct.append(data)
        real_write(self, data)

    watcher_tasks: list[object] = []
    real_watch = client_channel.DisconnectWatch._watch

    async def watch(self, request):
        watcher_tasks.append(request)
        await real_watch(self, request)

    monkeypatch.setattr(front_protocol.DirectWriter, "write", write)
    monkeypatch.setattr(client_channel.DisconnectWatch, "_watch", watch)
    for d in ("d1", "d2"):
        engines[d].behavior.token_delay_s = 0.02
    with proxy(engines) as (base, _):
        body = {"model": "m", "prompt": SHORT, "max_tokens": 6, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        texts = [json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]]
        assert len("".join(texts).split()) == 6
        assert metric(base, "vllm_pd_ttft_seconds_count") == 1
        assert metric(base, "vllm_pd_requests_total", outcome="ok") == 1
        if server_path == "plain":
            assert direct == [] and len(watcher_tasks) == 1
            return
        assert direct and all(b"[DONE]" not in d for d in direct)
        assert b"".join(direct).decode() in "\n\n".join(events)  # a run of the middle events
        assert metric(base, "vllm_pd_itl_seconds_count") >= len(direct)
    assert watcher_tasks == []


def test_admission_limit_answers_429_with_retry_after(engines):
    for d in ("d1", "d2"):
        engines[d].behavior.delay_s = 1.0
    with proxy(engines, max_in_flight=1, max_queued=0) as (base, svc):

        async def go():
            async with httpx.AsyncClient(timeout=60) as client:
                body = {"model": "m", "prompt": SHORT, "max_tokens": 1}
                first = asyncio.create_task(client.post(f"{base}/v1/completions", json=body))
                deadline = time.monotonic() + 30
                while svc.admission.in_flight < 1:  # the first holds the only slot
                    assert time.monotonic() < deadline and not first.done()
                    await asyncio.sleep(0.01)
                second = await client.post(f"{base}/v1/completions", json=body)
                return await first, second

        first, second = asyncio.run(go())
        assert first.status_code == 200
        assert second.status_code == 429
        assert second.headers["retry-after"] == "1"
        assert second.json()["error"]["type"] == "RateLimitError"
        assert metric(base, "vllm_pd_rejected_total", reason="queue_full") == 1


@pytest.mark.parametrize("metrics_token", [None, "scrape"])
def test_metrics_and_health_detail_are_closed_with_an_api_key(engines, metrics_token):
    """With an API key set, /metrics (upstream URLs, traffic) needs a bearer token: the
    metrics token when one is set, else the API key. /health still answers everyone (load
    balancers probe it) but shows the fleet's size only with that token."""
    token = metrics_token or "sekret"
    overrides = {"metrics_token": metrics_token} if metrics_token else {}
    with proxy(engines, api_key="sekret", **overrides) as (base, _):
        for headers in ({}, {"Authorization": "Bearer nope"}):
            resp = httpx.get(f"{base}/metrics", headers=headers, timeout=60)
            assert resp.status_code == 401, resp.text
            assert engines["d1"].url not in resp.text
        ok = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {token}"})
        assert ok.status_code == 200 and "vllm_pd_requests_total" in ok.text
        assert engines["d1"].url in ok.text
        open_health = httpx.get(f"{base}/health", timeout=60)
        assert open_health.status_code == 200 and open_health.json() == {"status": "ok"}
        detail = httpx.get(f"{base}/health", headers={"Authorization": f"Bearer {token}"})
        assert detail.json() == {"status": "ok", "healthy_decode": 2, "healthy_prefill": 2}
    with proxy(engines) as (base, _):  # no key at all: both open (loopback by default)
        assert httpx.get(f"{base}/metrics", timeout=60).status_code == 200
        assert "healthy_decode" in httpx.get(f"{base}/health", timeout=60).json()


def test_api_key_and_admin_token(engines):
    with proxy(engines, api_key="sekret", admin_token="adm") as (base, _):
        body = {"model": "m", "prompt": SHORT, "max_tokens": 1}
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 401
        bad = httpx.post(
            f"{base}/v1/completions", json=body, headers={"Authorization": "Bearer nope"}
        )
        assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
        ok = httpx.post(
            f"{base}/v1/completions",
            json=body,
            headers={"Authorization": "Bearer sekret"},
            timeout=60,
        )
        assert ok.status_code == 200
        assert httpx.get(f"{base}/health", timeout=60).status_code == 200  # probes need no key
        assert (
            httpx.get(
                f"{base}/admin/fleet", headers={"Authorization": "Bearer sekret"}, timeout=60
            ).status_code
            == 401
        )
        fleet_state = httpx.get(
            f"{base}/admin/fleet", headers={"Authorization": "Bearer adm"}, timeout=60
        )
        assert fleet_state.status_code == 200 and len(fleet_state.json()) == 4
    with proxy(engines) as (base, _):
        assert httpx.get(f"{base}/admin/fleet", timeout=60).status_code == 404


def test_health_models_and_recovery(engines):
    one_decode = fleet(engines, decode=("d1",))
    with proxy(engines, instances=one_decode, no_decode_fallback=False) as (base, _):
        assert httpx.get(f"{base}/v1/models", timeout=60).json()["data"][0]["id"] == "fake"
        engines["d1"].behavior.health_status = 503
        wait_until(lambda: httpx.get(f"{base}/health", timeout=60).status_code == 503)
        resp = httpx.post(
            f"{base}/v1/completions", json={"model": "m", "prompt": SHORT}, timeout=60
        )
        assert resp.status_code == 503 and "retry-after" in resp.headers
        engines["d1"].behavior.health_status = 200
        wait_until(lambda: httpx.get(f"{base}/health", timeout=60).status_code == 200, timeout=15)


def test_watched_instances_file(engines, tmp_path, caplog):
    path = tmp_path / "fleet.json"

    def write(text: str, mtime: int) -> None:
        path.write_text(text)
        os.utime(path, (mtime, mtime))  # a distinct mtime, however fast the writes

    write(json.dumps({"instances": fleet(engines, prefill=(), decode=("d1",))}), 1_000_000)
    with proxy(engines, instances=[], instances_file=str(path)) as (_, svc):
        assert [i.url for i in svc.fleet.instances()] == [engines["d1"].url]
        write(json.dumps({"instances": fleet(engines, prefill=("p1",), decode=("d2",))}), 1_000_001)
        wait_until(lambda: {i.url for i in svc.fleet.healthy("decode")} == {engines["d2"].url})
        write("instances: [oops", 1_000_002)  # a bad edit keeps the last good fleet
        wait_until(lambda: "ignoring invalid" in caplog.text)
        assert {i.url for i in svc.fleet.instances()} == {engines["p1"].url, engines["d2"].url}


def test_completion_routes_take_post_only(engines):
    with proxy(engines) as (base, _):
        resp = httpx.get(f"{base}/v1/completions", timeout=60)
    assert resp.status_code == 405
    assert resp.json()["error"]["type"] == "MethodNotAllowedError"


def test_a_decode_answer_that_is_not_json_is_a_counted_502(engines):
    for d in ("d1", "d2"):
        engines[d].behavior.not_json = True
    with proxy(engines) as (base, _):
        resp = httpx.post(
            f"{base}/v1/completions", json={"model": "m", "prompt": SHORT}, timeout=60
        )
        assert resp.status_code == 502
        assert resp.json()["error"]["code"] == "decode_failed"
        assert "no JSON object" in resp.json()["error"]["message"]
        assert metric(base, "vllm_pd_requests_total", outcome="decode_failed") == 1
        assert metric(base, "vllm_pd_in_flight") == 0


def test_engine_load_figures_are_dropped_once_metrics_stop_answering(engines):
    engines["d1"].running = 7
    with proxy(engines, instances=fleet(engines, decode=("d1",))) as (_, svc):
        (d1,) = svc.fleet.healthy("decode")
        wait_until(lambda: d1.running == 7)
        engines["d1"].behavior.metrics_status = 500  # /health still answers
        wait_until(lambda: d1.running == 0)
        assert d1.healthy and d1.metrics_at == 0.0
    engines["d1"].running = 0


@pytest.mark.parametrize("stalled_on", ["prefill", "decode"])
def test_a_stalled_split_stream_is_served_colocated_before_the_client_sees_a_byte(
    engines, stalled_on
):
    """The decode engine answers the split leg's head, then sends no token (a stalled KV
    transfer): past the guard's deadline the leg is closed (the engine sees the disconnect)
    and the request served colocated, whole, as a colocated request is, on the instance
    ``stalled_on`` names (the prefill instance by default: its cache holds the prompt);
    counted."""
    one_pair = fleet(engines, prefill=("p1",), decode=("d1",))
    expected = _colocated_stream(engines, one_pair)
    engines["d1"].behavior.kv_stall_s = 600.0  # far past any client timeout here
    guard = {"floor_s": 0.5, "breaker_stalls": 5, "stalled_on": stalled_on}
    with proxy(engines, instances=one_pair, stall_guard=guard) as (base, _):
        assert _stream_events(base, 5, LONG) == expected
        wait_until(lambda: engines["d1"].disconnects == 1)
        d1_legs = [r["body"] for r in engines["d1"].requests]
        prefill_leg, *p1_legs = (r["body"] for r in engines["p1"].requests)
        assert prefill_leg["kv_transfer_params"]["do_remote_decode"] is True
        assert d1_legs[0]["kv_transfer_params"]["do_remote_prefill"] is True
        (colocated_leg,) = p1_legs if stalled_on == "prefill" else d1_legs[1:]
        assert len(d1_legs) == (1 if stalled_on == "prefill" else 2)
        assert "kv_transfer_params" not in colocated_leg and colocated_leg["stream"] is True
        assert metric(base, "vllm_pd_fallbacks_total", reason="stall") == 1
        assert metric(base, "vllm_pd_requests_total", decision="colocated", outcome="ok") == 1
        assert metric(base, "vllm_pd_transfer_gap_seconds_count") == 0  # no sample of a stall
        pair = {"prefill": engines["p1"].url, "decode": engines["d1"].url}
        assert metric(base, "vllm_pd_split_failures_total", reason="stall", **pair) == 1
        assert metric(base, "vllm_pd_in_flight") == 0


def test_a_stalled_split_stream_whose_prefill_froze_too_is_served_on_the_decode(engines):
    """The decode stalls on the KV, and the prefill instance, having answered its leg, sends
    no token of the colocated leg either (frozen since): that leg is closed at its own
    deadline (the guard's floor here) and the request served colocated on the decode
    instance, whole, long before the 120 s first-byte timeout; both counted."""
    one_pair = fleet(engines, prefill=("p1",), decode=("d1",))
    expected = _colocated_stream(engines, one_pair)
    engines["d1"].behavior.kv_stall_s = 600.0
    engines["p1"].behavior.colocated_stall_s = 600.0
    guard = {"floor_s": 0.5, "breaker_stalls": 5}
    with proxy(engines, instances=one_pair, stall_guard=guard) as (base, _):
        assert _stream_events(base, 5, LONG) == expected
        wait_until(lambda: engines["d1"].disconnects == 1 and engines["p1"].disconnects == 1)
        prefill_leg, frozen_leg = (r["body"] for r in engines["p1"].requests)
        assert prefill_leg["kv_transfer_params"]["do_remote_decode"] is True
        assert "kv_transfer_params" not in frozen_leg
        stalled_leg, colocated_leg = (r["body"] for r in engines["d1"].requests)
        assert stalled_leg["kv_transfer_params"]["do_remote_prefill"] is True
        assert "kv_transfer_params" not in colocated_leg and colocated_leg["stream"] is True
        assert metric(base, "vllm_pd_fallbacks_total", reason="stall") == 1
        assert metric(base, "vllm_pd_fallbacks_total", reason="colocated_stall") == 1
        assert metric(base, "vllm_pd_requests_total", decision="colocated", outcome="ok") == 1
        assert metric(base, "vllm_pd_in_flight") == 0


@contextmanager
def _d1_looks_idle(engines, **overrides) -> Iterator[tuple[str, ProxyService]]:
    """A proxy over p1, d1 and d2 (least-loaded decodes) that sees d2 busy, so d1 (frozen
    in these tests: a wedged engine reports nothing running) is always the idlest decode."""
    instances = fleet(engines, prefill=("p1",), decode=("d1", "d2"))
    engines["d2"].running = 5
    try:
        with proxy(engines, instances=instances, decode_policy="least-loaded", **overrides) as (
            base,
            svc,
        ):
            wait_until(lambda: any(d.running == 5 for d in svc.fleet.healthy("decode")))
            yield base, svc
    finally:
        engines["d2"].running = 0


def test_a_stalled_split_whose_pair_froze_is_served_on_another_decode(engines):
    """The decode stalls on the KV and then stays frozen (it looks the idlest), and the
    prefill instance froze after its leg too: the colocated leg there is closed at its
    deadline, and the request is served on the other decode instance, not left waiting on
    the decode that just stalled (which then has no deadline); counted."""
    one_pair = fleet(engines, prefill=("p1",), decode=("d1",))
    expected = _colocated_stream(engines, one_pair)
    engines["d1"].behavior.kv_stall_s = 600.0
    engines["d1"].behavior.colocated_stall_s = 600.0
    engines["p1"].behavior.colocated_stall_s = 600.0
    guard = {"floor_s": 0.5, "breaker_stalls": 5}
    with _d1_looks_idle(engines, stall_guard=guard) as (base, _):
        assert _stream_events(base, 5, LONG) == expected
        wait_until(lambda: engines["d1"].disconnects == 1 and engines["p1"].disconnects == 1)
        (stalled_leg,) = sent(engines["d1"])
        assert stalled_leg["kv_transfer_params"]["do_remote_prefill"] is True
        (served,) = sent(engines["d2"])
        assert "kv_transfer_params" not in served and served["stream"] is True
        assert metric(base, "vllm_pd_fallbacks_total", reason="stall") == 1
        assert metric(base, "vllm_pd_fallbacks_total", reason="colocated_stall") == 1
        assert metric(base, "vllm_pd_requests_total", decision="colocated", outcome="ok") == 1
        assert metric(base, "vllm_pd_in_flight") == 0


def test_a_stream_routed_colocated_to_a_broken_decode_that_froze_moves_on(engines):
    """A decode that stalled opens its breaker; a stream routed there next is served
    colocated on it (``breaker_open``). It is frozen: past the guard's floor (the cost model
    has no prefill measured) the leg is closed and the request served on the other decode
    instance, instead of waiting on the frozen one; counted."""
    expected = _colocated_stream(engines, fleet(engines))
    engines["d1"].behavior.kv_stall_s = 600.0
    engines["d1"].behavior.colocated_stall_s = 600.0
    guard = {"floor_s": 0.5, "breaker_stalls": 1, "breaker_open_s": 600.0}
    with _d1_looks_idle(engines, stall_guard=guard) as (base, _):
        assert _stream_events(base, 5, LONG) == expected  # the stall, served on p1
        assert _stream_events(base, 5, LONG) == expected  # breaker open: colocated on d1
        wait_until(lambda: engines["d1"].disconnects == 2)
        stalled_leg, frozen_leg = sent(engines["d1"])
        assert stalled_leg["kv_transfer_params"]["do_remote_prefill"] is True
        assert "kv_transfer_params" not in frozen_leg
        (served,) = sent(engines["d2"])
        assert "kv_transfer_params" not in served and served["stream"] is True
        assert metric(base, "vllm_pd_decisions_total", reason="breaker_open") == 1
        assert metric(base, "vllm_pd_fallbacks_total", reason="colocated_stall") == 1
        assert metric(base, "vllm_pd_in_flight") == 0


def _whole(base: str, body: dict) -> dict:
    resp = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_a_non_streamed_split_loads_its_kv_under_the_guard_then_answers_from_the_decode(engines):
    """A non-streamed split's decode leg is two steps on the same decode instance: the
    one-token leg with the KV params (its answer is the first token, so the guard can time
    it), then the client's request as it came, colocated (the prompt's KV is in that
    instance's prefix cache now). The answer is the colocated one; the transfer is measured."""
    one_pair = fleet(engines, prefill=("p1",), decode=("d1",))
    body = {"model": "m", "prompt": LONG, "max_tokens": 5, "min_tokens": 3}
    with proxy(engines, instances=one_pair, decision=COLOCATED) as (base, _):
        expected = _whole(base, body)["choices"]
    engines["d1"].requests.clear()
    with proxy(engines, instances=one_pair) as (base, _):
        assert _whole(base, body)["choices"] == expected
        first, rest = (r["body"] for r in engines["d1"].requests)
        assert first["kv_transfer_params"]["do_remote_prefill"] is True
        assert first["max_tokens"] == 1 and first["stream"] is False
        assert "min_tokens" not in first
        assert rest == body  # the client's request, as it came
        assert metric(base, "vllm_pd_requests_total", decision="split", outcome="ok") == 1
        pair = {"prefill": engines["p1"].url, "decode": engines["d1"].url}
        assert metric(base, "vllm_pd_transfer_gap_seconds_count", **pair) == 1
        assert metric(base, "vllm_pd_in_flight") == 0


@pytest.mark.parametrize("why", ["guard off for them", "decode without prefix caching"])
def test_non_streamed_splits_unguarded_send_one_decode_leg(engines, why):
    """With ``non_streamed: false``, or to a decode instance whose ``/metrics`` says its
    prefix cache is off (a second step would compute the whole prompt again), a non-streamed
    split is one decode leg, unguarded."""
    one_pair = fleet(engines, prefill=("p1",), decode=("d1",))
    body = {"model": "m", "prompt": LONG, "max_tokens": 5}
    guard = {"non_streamed": why != "guard off for them"}
    engines["d1"].behavior.prefix_caching = why != "decode without prefix caching"
    with proxy(engines, instances=one_pair, stall_guard=guard) as (base, _):
        _whole(base, body)
        (leg,) = (r["body"] for r in engines["d1"].requests)
        assert leg["kv_transfer_params"]["do_remote_prefill"] is True
        assert leg["max_tokens"] == 5


def test_a_stalled_non_streamed_split_is_served_colocated_on_its_prefill_instance(engines):
    """The decode engine never answers the one-token leg (a stalled KV transfer): past the
    guard's deadline the leg is closed (the engine sees the disconnect) and the request is
    served colocated on the prefill instance, with the colocated answer; counted."""
    one_pair = fleet(engines, prefill=("p1",), decode=("d1",))
    body = {"model": "m", "prompt": LONG, "max_tokens": 5}
    with proxy(engines, instances=one_pair, decision=COLOCATED) as (base, _):
        expected = _whole(base, body)["choices"]
    engines["d1"].requests.clear()
    engines["d1"].behavior.kv_stall_s = 600.0
    guard = {"floor_s": 0.5, "breaker_stalls": 5}
    with proxy(engines, instances=one_pair, stall_guard=guard) as (base, _):
        assert _whole(base, body)["choices"] == expected
        wait_until(lambda: engines["d1"].disconnects == 1)
        (stalled,) = (r["body"] for r in engines["d1"].requests)
        assert stalled["kv_transfer_params"]["do_remote_prefill"] is True
        prefill_leg, colocated_leg = (r["body"] for r in engines["p1"].requests)
        assert prefill_leg["max_tokens"] == 1 and colocated_leg == body
        assert metric(base, "vllm_pd_fallbacks_total", reason="stall") == 1
        assert metric(base, "vllm_pd_requests_total", decision="colocated", outcome="ok") == 1
        assert metric(base, "vllm_pd_in_flight") == 0


def test_a_pair_that_keeps_stalling_gets_no_splits_while_its_breaker_is_open(engines):
    """Two stalls in a row open the pair's breaker: the next long prompt is served colocated
    without a prefill leg (reason ``breaker_open``) and /metrics shows the breaker open."""
    one_pair = fleet(engines, prefill=("p1",), decode=("d1",))
    engines["d1"].behavior.kv_stall_s = 600.0
    guard = {"floor_s": 0.3, "breaker_stalls": 2, "breaker_open_s": 600.0}
    p1, d1 = engines["p1"].url, engines["d1"].url
    with proxy(engines, instances=one_pair, stall_guard=guard) as (base, _):
        for _ in range(2):
            assert _stream_events(base, 5, LONG)[-1] == "data: [DONE]"
        assert metric(base, "vllm_pd_breaker_open", prefill=p1, decode=d1) == 1
        prefill_legs = len(engines["p1"].requests)
        assert _stream_events(base, 5, LONG)[-1] == "data: [DONE]"
        assert len(engines["p1"].requests) == prefill_legs  # no split tried
        assert metric(base, "vllm_pd_decisions_total", reason="breaker_open") == 1
        assert metric(base, "vllm_pd_fallbacks_total", reason="stall") == 2


def test_with_no_healthy_decode_instance_a_prefill_instance_serves_requests_whole(engines):
    """Degraded, not down: every decode instance fails its health checks, so a long prompt
    (which would split) is served whole on a prefill instance, counted, and /health says
    so with a 200; once a decode instance is back, requests split again."""
    with proxy(engines) as (base, _):
        for d in ("d1", "d2"):
            engines[d].behavior.health_status = 503
        wait_until(lambda: httpx.get(f"{base}/health", timeout=60).json()["healthy_decode"] == 0)
        health = httpx.get(f"{base}/health", timeout=60)
        assert health.status_code == 200 and health.json()["status"] == "degraded_no_decode"
        body = {"model": "m", "prompt": LONG, "max_tokens": 4}
        resp = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        legs = [r["body"] for p in ("p1", "p2") for r in engines[p].requests]
        assert len(legs) == 1 and "kv_transfer_params" not in legs[0]  # whole, no split
        assert legs[0]["max_tokens"] == 4
        assert engines["d1"].requests == engines["d2"].requests == []
        assert metric(base, "vllm_pd_fallbacks_total", reason="no_decode") == 1
        assert metric(base, "vllm_pd_decisions_total", reason="no_decode") == 1
        engines["d1"].behavior.health_status = 200
        wait_until(lambda: httpx.get(f"{base}/health", timeout=60).json()["status"] == "ok")
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200
        assert metric(base, "vllm_pd_decisions_total", decision="split") == 1


def test_a_prefill_leg_past_its_deadline_is_served_colocated(engines):
    """Once the cost model has measured prefill legs, one that takes far longer (a starved
    prefill engine) is closed at the stall guard's deadline and the request served
    colocated, long before the slow prefill would have answered; counted."""
    one_pair = fleet(engines, prefill=("p1",), decode=("d1",))
    body = {"model": "m", "prompt": LONG, "max_tokens": 5}
    with proxy(engines, instances=one_pair) as (base, svc):
        measured = svc.router.decider.prefill_s_per_token
        for _ in range(20):  # until cost_min_samples splits are measured
            _whole(base, body)
            if measured.samples >= 5:
                break
        assert measured.samples >= 5
        engines["p1"].behavior.delay_s = 30.0
        assert _whole(base, body)["choices"][0]["text"]  # (the slow prefill: 30 s, a split)
        wait_until(lambda: engines["p1"].disconnects == 1)  # its leg was closed
        assert metric(base, "vllm_pd_fallbacks_total", reason="prefill_stall") == 1
        assert metric(base, "vllm_pd_fallbacks_total", reason="prefill_failed") == 1
        assert metric(base, "vllm_pd_requests_total", decision="colocated", outcome="ok") == 1


def test_prefill_legs_that_keep_missing_their_deadline_open_the_pairs_breaker(engines):
    """A prefill engine that keeps stalling is a stalled pair, as a stalled transfer is:
    ``breaker_stalls`` prefill legs closed at their deadline in a row open the pair's
    breaker, and the next request is served colocated without a prefill leg."""
    one_pair = fleet(engines, prefill=("p1",), decode=("d1",))
    body = {"model": "m", "prompt": LONG, "max_tokens": 5}
    guard = {"floor_s": 0.3, "breaker_stalls": 2, "breaker_open_s": 600.0}
    p1, d1 = engines["p1"].url, engines["d1"].url
    with proxy(engines, instances=one_pair, stall_guard=guard) as (base, svc):
        measured = svc.router.decider.prefill_s_per_token
        for _ in range(20):  # until cost_min_samples splits are measured
            _whole(base, body)
            if measured.samples >= 5:
                break
        assert measured.samples >= 5
        engines["p1"].behavior.delay_s = 30.0
        for stalls in (1, 2):
            assert _whole(base, body)["choices"][0]["text"]
            wait_until(lambda n=stalls: engines["p1"].disconnects == n)
        assert metric(base, "vllm_pd_fallbacks_total", reason="prefill_stall") == 2
        assert metric(base, "vllm_pd_breaker_open", prefill=p1, decode=d1) == 1
        failures = metric(
            base, "vllm_pd_split_failures_total", prefill=p1, decode=d1, reason="prefill_stall"
        )
        assert failures == 2
        prefill_legs = len(engines["p1"].requests)
        assert _whole(base, body)["choices"][0]["text"]
        assert len(engines["p1"].requests) == prefill_legs  # no split tried
        assert metric(base, "vllm_pd_decisions_total", reason="breaker_open") == 1


def test_once_a_breakers_open_time_is_over_one_split_probes_it_not_every_one_routed_meanwhile(
    engines,
):
    """The probe is marked when its prefill leg starts: a request routed while that (slow)
    prefill leg runs is served colocated (``breaker_open``), not split across the pair too."""
    one_pair = fleet(engines, prefill=("p1",), decode=("d1",))
    # the second request must be routed while the probe's prefill leg runs and within
    # breaker_open_s of its start (else it probes too): both long enough for a loaded host
    guard = {"floor_s": 0.3, "breaker_stalls": 1, "breaker_open_s": 6.0}
    engines["d1"].behavior.kv_stall_s = 600.0
    with proxy(engines, instances=one_pair, stall_guard=guard) as (base, svc):
        assert _stream_events(base, 5, LONG)[-1] == "data: [DONE]"  # the stall: breaker open
        assert metric(base, "vllm_pd_fallbacks_total", reason="stall") == 1
        engines["d1"].behavior.kv_stall_s = 0.0
        engines["p1"].behavior.delay_s = 6.0  # the probe's prefill leg takes a while
        (p1,) = svc.fleet.healthy("prefill")
        (d1,) = svc.fleet.healthy("decode")
        wait_until(lambda: svc.router.guard.allows(p1, d1, True))  # the open time is over
        legs = len(engines["p1"].requests)
        with ThreadPoolExecutor(1) as pool:
            probe = pool.submit(_stream_events, base, 5, LONG)
            wait_until(lambda: len(engines["p1"].requests) == legs + 1)  # its prefill leg
            assert _stream_events(base, 5, LONG)[-1] == "data: [DONE]"
            assert probe.result(timeout=60)[-1] == "data: [DONE]"
        assert len(engines["p1"].requests) == legs + 1  # one split across the pair: the probe
        assert metric(base, "vllm_pd_decisions_total", reason="breaker_open") == 1


def test_a_stalled_split_whose_prefill_went_down_is_served_on_another_decode_first(engines):
    """The decode stalls on the KV and the prefill instance fails its health checks
    meanwhile: the colocated leg goes to the other decode first, not back to the decode
    that just stalled (tried only when no other is healthy)."""
    one_pair = fleet(engines, prefill=("p1",), decode=("d1",))
    expected = _colocated_stream(engines, one_pair)
    engines["d1"].behavior.kv_stall_s = 600.0
    engines["d1"].behavior.colocated_stall_s = 600.0
    guard = {"floor_s": 3.0, "breaker_stalls": 5}
    with _d1_looks_idle(engines, stall_guard=guard) as (base, svc), ThreadPoolExecutor(1) as pool:
        stream = pool.submit(_stream_events, base, 5, LONG)
        wait_until(lambda: len(engines["p1"].requests) == 1)  # the prefill leg: done
        engines["p1"].behavior.health_status = 503
        wait_until(lambda: not svc.fleet.healthy("prefill"))
        assert stream.result(timeout=60) == expected
        (stalled_leg,) = sent(engines["d1"])  # not tried again
        assert stalled_leg["kv_transfer_params"]["do_remote_prefill"] is True
        (served,) = sent(engines["d2"])
        assert "kv_transfer_params" not in served and served["stream"] is True
        assert metric(base, "vllm_pd_fallbacks_total", reason="stall") == 1
        assert metric(base, "vllm_pd_fallbacks_total", reason="colocated_stall") == 0
