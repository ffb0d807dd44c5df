"""``within``: a time limit that never loses the caller's cancellation."""

from __future__ import annotations

import asyncio

import pytest

from vllm_pd_ext.util.aio import within


def _nothing_to_undo(result: object) -> None:
    pytest.fail(f"undo called with {result!r}")


def test_returns_the_result_in_time():
    async def go():
        return await within(asyncio.sleep(0, "x"), 1.0, _nothing_to_undo)

    assert asyncio.run(go()) == "x"


def test_times_out_and_cancels_the_awaitable():
    async def go():
        inner = asyncio.ensure_future(asyncio.sleep(10))
        with pytest.raises(asyncio.TimeoutError):
            await within(inner, 0.01, _nothing_to_undo)
        await asyncio.sleep(0)
        return inner.cancelled()

    assert asyncio.run(go()) is True


def test_a_result_made_after_the_time_ran_out_is_undone():
    undone: list[str] = []

    async def stubborn() -> str:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            return "made anyway"  # a connection that completed as it was cancelled
        return "in time"

    async def go():
        with pytest.raises(asyncio.TimeoutError):
            await within(stubborn(), 0.01, undone.append)
        for _ in range(3):
            await asyncio.sleep(0)

    asyncio.run(go())
    assert undone == ["made anyway"]


def test_cancellation_meeting_completion_propagates_and_undoes_the_result():
    """What ``asyncio.wait_for`` loses before Python 3.12: the awaited thing completes in the
    same loop step as the caller is cancelled. The caller must see the cancellation and the
    result must be undone (a connection closed, a slot given back)."""
    undone: list[str] = []

    async def go():
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(within(fut, 5.0, undone.append))
        await asyncio.sleep(0)  # the task waits on fut
        fut.set_result("connection")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(3):
            await asyncio.sleep(0)

    asyncio.run(go())
    assert undone == ["connection"]


def test_cancellation_while_waiting_cancels_the_awaitable():
    async def go():
        inner = asyncio.ensure_future(asyncio.sleep(10))
        task = asyncio.ensure_future(within(inner, None, _nothing_to_undo))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0)
        return inner.cancelled()

    assert asyncio.run(go()) is True
