"""Cancelling what a request waits for never swallows a cancellation of the request itself
(a swallowed one would carry on serving a request nobody waits for)."""

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
