"""The stall guard's hedge end to end against fake engines: a late split stream is started
colocated beside it, and whichever leg answers first serves the request."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.unit.proxy.helpers import LONG, fleet, metric, proxy, sent, wait_until
from tests.unit.proxy.test_proxy_flow import _colocated_stream, _stream_events

#: Hedging on; no deadline a test could reach (the hedge alone must serve; a prefill leg has
#: none until measured), and a hedge delay beyond a prefill leg of the fake engines on a
#: loaded host.
HEDGE = {"hedge": True, "hedge_unmeasured_s": 1.5, "floor_s": 600.0, "breaker_stalls": 5}


def _hedge_legs(engine) -> list[dict]:
    return [r for r in engine.requests if r["headers"]["x-request-id"].endswith("-hedge")]


def test_a_late_decode_leg_is_hedged_on_the_prefill_instance_which_answers_first(engines):
    """The decode engine answers the split leg's head, then no token (a stalled KV transfer)
    for longer than the client waits: once the split is late the request is started
    colocated on the prefill instance (its cache holds the prompt), that leg serves it with
    the colocated answer, and the split leg is closed (the engine sees it go); counted as a
    hedge, not a stall."""
    one_pair = fleet(engines, prefill=("p1",), decode=("d1",))
    expected = _colocated_stream(engines, one_pair)
    engines["d1"].behavior.kv_stall_s = 600.0
    with proxy(engines, instances=one_pair, stall_guard=HEDGE) as (base, svc):
        assert _stream_events(base, 5, LONG) == expected
        wait_until(lambda: engines["d1"].disconnects == 1)  # the split leg, closed
        (split_leg,) = sent(engines["d1"])
        assert split_leg["kv_transfer_params"]["do_remote_prefill"] is True
        prefill_leg, hedge_leg = engines["p1"].requests
        assert prefill_leg["body"]["kv_transfer_params"]["do_remote_decode"] is True
        assert _hedge_legs(engines["p1"]) == [hedge_leg]
        assert "kv_transfer_params" not in hedge_leg["body"]
        assert hedge_leg["body"]["stream"] is True
        assert metric(base, "vllm_pd_hedges_total", leg="decode", outcome="colocated") == 1
        assert metric(base, "vllm_pd_fallbacks_total", reason="hedge") == 1
        assert metric(base, "vllm_pd_fallbacks_total", reason="stall") == 0
        pair = {"prefill": engines["p1"].url, "decode": engines["d1"].url}
        assert metric(base, "vllm_pd_split_failures_total", reason="hedge", **pair) == 1
        assert metric(base, "vllm_pd_requests_total", decision="colocated", outcome="ok") == 1
        assert metric(base, "vllm_pd_in_flight") == 0
        assert svc.router.guard.hedging == 0


def test_a_late_prefill_leg_is_hedged_on_the_decode_instance_which_answers_first(engines):
    """The prefill engine does not answer its leg: once the split is late the request is
    started colocated on the decode instance, that leg serves it with the colocated answer,
    and the prefill leg is closed (the engine sees it go); no decode leg is sent."""
    one_pair = fleet(engines, prefill=("p1",), decode=("d1",))
    expected = _colocated_stream(engines, one_pair)
    engines["p1"].behavior.delay_s = 600.0
    with proxy(engines, instances=one_pair, stall_guard={**HEDGE, "hedge_unmeasured_s": 0.3}) as (
        base,
        svc,
    ):
        assert _stream_events(base, 5, LONG) == expected
        wait_until(lambda: engines["p1"].disconnects == 1)  # the prefill leg, closed
        (hedge_leg,) = engines["d1"].requests
        assert _hedge_legs(engines["d1"]) == [hedge_leg]
        assert "kv_transfer_params" not in hedge_leg["body"]
        assert metric(base, "vllm_pd_hedges_total", leg="prefill", outcome="colocated") == 1
        assert metric(base, "vllm_pd_fallbacks_total", reason="hedge") == 1
        assert metric(base, "vllm_pd_fallbacks_total", reason="prefill_stall") == 0
        assert metric(base, "vllm_pd_fallbacks_total", reason="prefill_failed") == 0
        assert metric(base, "vllm_pd_requests_total", decision="colocated", outcome="ok") == 1
        assert metric(base, "vllm_pd_in_flight") == 0
        assert svc.router.guard.hedging == 0


def test_a_late_split_that_answers_first_serves_and_its_hedge_leg_is_closed(engines):
    """The split's decode leg is late but answers while the hedge's colocated leg (on a
    prefill instance frozen since its leg) has not: the split serves the request and the
    hedge leg is closed (the engine sees it go); counted."""
    one_pair = fleet(engines, prefill=("p1",), decode=("d1",))
    expected = _colocated_stream(engines, one_pair)
    engines["d1"].behavior.kv_stall_s = 4.0
    engines["p1"].behavior.colocated_stall_s = 600.0
    with proxy(engines, instances=one_pair, stall_guard=HEDGE) as (base, svc):
        assert _stream_events(base, 5, LONG) == expected
        wait_until(lambda: engines["p1"].disconnects == 1)  # the hedge leg, closed
        assert len(_hedge_legs(engines["p1"])) == 1
        assert engines["d1"].disconnects == 0
        assert metric(base, "vllm_pd_hedges_total", leg="decode", outcome="split") == 1
        assert metric(base, "vllm_pd_fallbacks_total", reason="hedge") == 0
        assert metric(base, "vllm_pd_requests_total", decision="split", outcome="ok") == 1
        assert metric(base, "vllm_pd_in_flight") == 0
        assert svc.router.guard.hedging == 0


def test_hedged_requests_in_flight_are_bounded(engines):
    """With ``hedge_max_in_flight: 1``, a second late split while the first one's hedge runs
    is not hedged (counted): it waits for its own leg, which serves it."""
    one_pair = fleet(engines, prefill=("p1",), decode=("d1",))
    engines["d1"].behavior.kv_stall_s = 6.0
    engines["p1"].behavior.colocated_stall_s = 600.0  # the hedge legs never answer
    guard = {**HEDGE, "hedge_unmeasured_s": 1.0, "hedge_max_in_flight": 1}
    with (
        proxy(engines, instances=one_pair, stall_guard=guard) as (base, svc),
        ThreadPoolExecutor(2) as pool,
    ):
        first = pool.submit(_stream_events, base, 5, LONG)
        wait_until(lambda: svc.router.guard.hedging == 1)
        second = pool.submit(_stream_events, base, 5, LONG)
        for stream in (first, second):
            assert stream.result(timeout=60)[-1] == "data: [DONE]"
        assert len(_hedge_legs(engines["p1"]) + _hedge_legs(engines["d1"])) == 1
        assert metric(base, "vllm_pd_hedges_total", outcome="bound") >= 1
        assert metric(base, "vllm_pd_hedges_total", outcome="split") == 1
        assert metric(base, "vllm_pd_requests_total", decision="split", outcome="ok") == 2
        assert svc.router.guard.hedging == 0


def test_a_split_past_its_deadline_while_hedged_is_served_by_the_hedges_leg(engines):
    """The deadline stays the hard stop behind the hedge: the stalled decode leg is closed
    at it and counted as a stall, and the request is served by the hedge's colocated leg
    already under way (slow, but within its own deadline), not by a third leg."""
    one_pair = fleet(engines, prefill=("p1",), decode=("d1",))
    expected = _colocated_stream(engines, one_pair)
    engines["d1"].behavior.kv_stall_s = 600.0
    engines["p1"].behavior.colocated_stall_s = 3.0
    with proxy(engines, instances=one_pair, stall_guard={**HEDGE, "floor_s": 4.0}) as (base, svc):
        assert _stream_events(base, 5, LONG) == expected
        wait_until(lambda: engines["d1"].disconnects == 1)  # the split leg, closed
        prefill_leg, hedge_leg = engines["p1"].requests
        assert prefill_leg["body"]["kv_transfer_params"]["do_remote_decode"] is True
        assert _hedge_legs(engines["p1"]) == [hedge_leg]
        assert len(engines["d1"].requests) == 1
        assert metric(base, "vllm_pd_hedges_total", leg="decode", outcome="rescue") == 1
        assert metric(base, "vllm_pd_fallbacks_total", reason="stall") == 1
        assert metric(base, "vllm_pd_fallbacks_total", reason="hedge") == 0
        assert metric(base, "vllm_pd_requests_total", decision="colocated", outcome="ok") == 1
        assert svc.router.guard.hedging == 0


def test_a_hedge_whose_leg_failed_is_not_where_the_stalled_split_is_served_next(engines):
    """The split's decode leg stalls and the hedge's leg, on the prefill instance, froze too:
    once the split is past its deadline and the hedge's leg past its own, the request is
    served on the decode instance, not sent to the frozen prefill instance a third time."""
    one_pair = fleet(engines, prefill=("p1",), decode=("d1",))
    expected = _colocated_stream(engines, one_pair)
    engines["d1"].behavior.kv_stall_s = 600.0
    engines["p1"].behavior.colocated_stall_s = 600.0
    with proxy(engines, instances=one_pair, stall_guard={**HEDGE, "floor_s": 3.0}) as (base, svc):
        assert _stream_events(base, 5, LONG) == expected
        wait_until(lambda: engines["d1"].disconnects == 1 and engines["p1"].disconnects == 1)
        prefill_leg, hedge_leg = engines["p1"].requests
        assert prefill_leg["body"]["kv_transfer_params"]["do_remote_decode"] is True
        assert _hedge_legs(engines["p1"]) == [hedge_leg]
        split_leg, served = sent(engines["d1"])
        assert split_leg["kv_transfer_params"]["do_remote_prefill"] is True
        assert "kv_transfer_params" not in served
        assert metric(base, "vllm_pd_hedges_total", leg="decode", outcome="failed") == 1
        assert metric(base, "vllm_pd_fallbacks_total", reason="stall") == 1
        # the hedge's leg was the stall's colocated leg once the split missed its deadline
        assert metric(base, "vllm_pd_fallbacks_total", reason="colocated_stall") == 1
        assert svc.router.guard.hedging == 0


def test_a_client_that_leaves_while_hedged_has_both_legs_closed(engines):
    """The client leaves while the split's decode leg and the hedge's leg both wait for their
    first token: both are closed (each engine sees its leg go) and the hedge is given back."""
    one_pair = fleet(engines, prefill=("p1",), decode=("d1",))
    engines["d1"].behavior.kv_stall_s = 600.0
    engines["p1"].behavior.colocated_stall_s = 600.0
    with proxy(engines, instances=one_pair, stall_guard=HEDGE) as (base, svc):

        async def leave_once_hedged():
            body = {"model": "m", "prompt": LONG, "max_tokens": 5, "stream": True}
            async with httpx.AsyncClient(timeout=60) as client:
                stream = asyncio.ensure_future(client.post(f"{base}/v1/completions", json=body))
                deadline = time.monotonic() + 30
                while svc.router.guard.hedging == 0 and not stream.done():
                    assert time.monotonic() < deadline, "no hedge started"
                    await asyncio.sleep(0.02)
                assert not stream.done()
                stream.cancel()  # the client leaves
                await asyncio.wait((stream,))

        asyncio.run(leave_once_hedged())
        wait_until(lambda: engines["d1"].disconnects == 1 and engines["p1"].disconnects == 1)
        wait_until(lambda: svc.admission.in_flight == 0)
        assert len(_hedge_legs(engines["p1"])) == 1
        assert metric(base, "vllm_pd_hedges_total", outcome="abandoned") == 1
        assert metric(base, "vllm_pd_aborts_total", phase="decode_wait") == 1
        assert svc.router.guard.hedging == 0


@pytest.mark.parametrize("decodes", [("d1",), ("d1", "d2")])
def test_a_split_whose_decode_leg_fails_while_hedged_is_served_by_the_hedges_leg(engines, decodes):
    """The split's decode leg answers 500 while its hedge's leg (on the prefill instance) is
    under way: the hedge serves the request as the split's rescue (no other decode tried,
    no 502 with one decode instance), and the failure counts once, as the decode error it
    was, not also as a hedge beating the split."""
    pool = fleet(engines, prefill=("p1",), decode=decodes)
    expected = _colocated_stream(engines, pool)
    for name in decodes:  # the split's leg fails once its hedge (at 1.5 s) is under way
        engines[name].behavior.delay_s = 3.0
        engines[name].behavior.status = 500
    engines["p1"].behavior.colocated_stall_s = 6.0  # the hedge answers at about 7.5 s
    with proxy(engines, instances=pool, stall_guard=HEDGE) as (base, svc):
        assert _stream_events(base, 5, LONG) == expected
        (split_leg,) = sent(engines["d1"])
        assert split_leg["kv_transfer_params"]["do_remote_prefill"] is True
        assert all(not engines[name].requests for name in decodes[1:])
        assert len(_hedge_legs(engines["p1"])) == 1
        assert metric(base, "vllm_pd_hedges_total", leg="decode", outcome="rescue") == 1
        assert metric(base, "vllm_pd_hedges_total", outcome="colocated") == 0
        assert metric(base, "vllm_pd_fallbacks_total", reason="hedge") == 0
        pair = {"prefill": engines["p1"].url, "decode": engines["d1"].url}
        assert metric(base, "vllm_pd_split_failures_total", reason="decode_error", **pair) == 1
        assert metric(base, "vllm_pd_split_failures_total", reason="hedge", **pair) == 0
        assert not svc.router.guard._pairs  # no stall on record for the breaker
        assert svc.router.guard.hedging == 0


def test_a_prefill_leg_past_its_deadline_then_beaten_by_the_hedge_counts_once(engines):
    """p1's prefill leg misses its deadline (a prefill stall of p1 -> d1) while the hedge's
    leg on d1 is under way, the leg retried on p2 is late too, and the hedge answers first:
    it serves as the split's rescue; the one stall is p1's, not a second one for the hedge."""
    pool = fleet(engines, prefill=("p1", "p2"), decode=("d1",))
    expected = _colocated_stream(engines, pool)
    engines["p1"].behavior.delay_s = 600.0
    engines["p2"].behavior.delay_s = 600.0
    # prefill legs measured at 2 s: the hedge at 3.05 s, p1's deadline at 8 s (factor 4),
    # the hedge's leg answers at about 3.05 + 6.5 s, within its own 8 s
    engines["d1"].behavior.colocated_stall_s = 6.5
    guard = {**HEDGE, "floor_s": 1.0, "breaker_stalls": 5}
    with proxy(engines, instances=pool, stall_guard=guard) as (base, svc):
        for _ in range(5):
            svc.router.decider.observe(500, prefill_s=2.0, transfer_gap_s=0.0)
        assert _stream_events(base, 5, LONG) == expected
        assert [len(sent(engines[p])) for p in ("p1", "p2")] == [1, 1]
        assert metric(base, "vllm_pd_fallbacks_total", reason="prefill_stall") == 1
        assert metric(base, "vllm_pd_fallbacks_total", reason="hedge") == 0
        assert metric(base, "vllm_pd_hedges_total", leg="prefill", outcome="rescue") == 1
        stalls = {pair: state.stalls for pair, state in svc.router.guard._pairs.items()}
        assert stalls == {(engines["p1"].url, engines["d1"].url): 1}
        assert svc.router.guard.hedging == 0


def test_splits_beaten_by_their_hedge_are_measured_at_what_they_took(engines):
    """Every split stalls on its KV and its hedge wins: what each split took until then is
    a sample of the typical split, so a pair whose splits all lose is measured (and the next
    hedge waits for 1.5x that) instead of being hedged at the unmeasured delay for ever."""
    one_pair = fleet(engines, prefill=("p1",), decode=("d1",))
    engines["d1"].behavior.kv_stall_s = 600.0
    with proxy(engines, instances=one_pair, stall_guard=HEDGE) as (base, svc):
        decider = svc.router.decider
        for _ in range(5):  # cost_min_samples
            assert decider.expected_transfer_s(500) is None
            assert _stream_events(base, 5, LONG)[-1] == "data: [DONE]"
        assert metric(base, "vllm_pd_hedges_total", leg="decode", outcome="colocated") == 5
        transfer = decider.expected_transfer_s(500)
        assert transfer is not None and transfer >= 1.0  # the hedge began 1.5 s after the start
        assert svc.router.guard.hedge_s(500) > HEDGE["hedge_unmeasured_s"]


def test_a_late_prefill_leg_is_not_hedged_where_a_failed_prefill_must_fail(engines):
    """With ``on_prefill_failure: retry-then-fail`` a split is never served colocated for a
    prefill's sake: a late prefill leg gets no hedge, and when it then fails the client gets
    the 502 that policy promises."""
    one_pair = fleet(engines, prefill=("p1",), decode=("d1",))
    engines["p1"].behavior.delay_s = 3.0  # past the hedge's 1.5 s, then a 500
    engines["p1"].behavior.status = 500
    with proxy(
        engines, instances=one_pair, stall_guard=HEDGE, on_prefill_failure="retry-then-fail"
    ) as (base, svc):
        body = {"model": "m", "prompt": LONG, "max_tokens": 5, "stream": True}
        resp = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 502
        assert resp.json()["error"]["code"] == "prefill_failed"
        assert not engines["d1"].requests
        assert metric(base, "vllm_pd_hedges_total") == 0
        assert svc.router.guard.hedging == 0
