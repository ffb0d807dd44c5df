"""Cancelling what a request waits for never swallows a cancellation of the request itself
(a swallowed one would carry on serving a request nobody waits for); what a request leaves
behind runs in bounded background work."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import Request

from vllm_pd_ext.proxy.client_channel import ClientGone, DisconnectWatch
from vllm_pd_ext.proxy.prefill import discard


def _slow_to_stop(stopping: asyncio.Event, stop: asyncio.Event):
    """A leg that takes its time to stop once cancelled."""

    async def leg() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            stopping.set()
            await stop.wait()
            raise

    return asyncio.ensure_future(leg())


def test_discarding_a_pending_leg_leaves_the_callers_own_cancellation_alone():
    async def go():
        stopping, stop = asyncio.Event(), asyncio.Event()
        pending = _slow_to_stop(stopping, stop)
        caller = asyncio.ensure_future(discard(pending))
        await stopping.wait()
        caller.cancel()
        await asyncio.sleep(0)
        stop.set()
        with pytest.raises(asyncio.CancelledError):
            await caller
        await asyncio.wait((pending,))
        return pending.cancelled()

    assert asyncio.run(go())


def test_a_raced_future_given_up_for_a_gone_client_leaves_the_callers_cancellation_alone():
    async def go():
        disconnect = asyncio.Event()

        async def receive():
            await disconnect.wait()
            return {"type": "http.disconnect"}

        scope = {"type": "http", "method": "POST", "path": "/", "headers": []}
        watch = DisconnectWatch(Request(scope, receive), hooked=False)
        stopping, stop = asyncio.Event(), asyncio.Event()
        pending = _slow_to_stop(stopping, stop)
        caller = asyncio.ensure_future(watch.race(pending, "decode_wait"))
        await asyncio.sleep(0)
        disconnect.set()  # the client leaves: the race gives the future up
        await stopping.wait()
        caller.cancel()  # and the request's task itself is cancelled meanwhile
        await asyncio.sleep(0)
        stop.set()
        try:
            await caller
        except asyncio.CancelledError:
            return "cancelled"
        except ClientGone:
            return "client_gone"
        return "returned"

    assert asyncio.run(go()) == "cancelled"


def test_background_work_past_its_limit_is_skipped_and_counted():
    """Drains and aborts a request leaves behind are bounded: past the limit the work is
    skipped (the engine's lease or the closed connection still frees what it holds) and
    counted, never queued without end."""
    from vllm_pd_ext.proxy.background import Background
    from vllm_pd_ext.proxy.metrics import ProxyMetrics
    from vllm_pd_ext.proxy.upstream import Timeouts

    async def go():
        metrics = ProxyMetrics()
        background = Background(2, metrics, Timeouts(), Timeouts())
        release = asyncio.Event()
        ran: list[int] = []

        async def work(i: int) -> None:
            ran.append(i)
            await release.wait()

        for i in range(4):
            background._spawn(work(i), f"work-{i}", "drain")
        await asyncio.sleep(0)
        running = len(background.tasks)
        release.set()
        await asyncio.gather(*background.tasks)
        skipped = metrics.background_skipped.labels("drain").value
        return running, sorted(ran), skipped, len(background.tasks)

    assert asyncio.run(go()) == (2, [0, 1], 2, 0)
