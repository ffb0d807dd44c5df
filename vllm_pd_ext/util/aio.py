"""Waiting with a time limit without losing the caller's cancellation.

``asyncio.wait_for`` before Python 3.12 loses a cancellation that meets the awaited thing's
completion: the caller gets the result and runs on as if nobody had cancelled it. The proxy
cancels a pending upstream request to abort it; a lost cancellation there sends the request
anyway and waits for its whole answer. ``within`` lets the cancellation win and hands what was
produced anyway to an ``undo`` (close the connection, give the slot back).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def within(awaitable: Awaitable[T], timeout: float | None, undo: Callable[[T], object]) -> T:
    """Await ``awaitable`` for at most ``timeout`` seconds (``None``: no limit).

    Raises ``asyncio.TimeoutError`` when the time runs out. A cancellation of the caller
    always propagates. Either way the awaitable is cancelled, and if it completes regardless,
    ``undo`` gets its result.
    """
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait((task,), timeout=timeout)
    except BaseException:
        _abandon(task, undo)
        raise
    if not done:
        _abandon(task, undo)
        raise asyncio.TimeoutError
    return task.result()


def _abandon(task: asyncio.Future[T], undo: Callable[[T], object]) -> None:
    task.cancel()

    def finished(task: asyncio.Future[T]) -> None:
        if not task.cancelled() and task.exception() is None:
            undo(task.result())

    task.add_done_callback(finished)
