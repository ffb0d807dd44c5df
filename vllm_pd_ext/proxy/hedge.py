"""A hedge: a late split stream's colocated leg, run beside it (the design: ``stall_guard.py``).

``race`` waits for a split's leg (the prefill leg, or the decode leg's first bytes). Past the
call's hedge time it starts the colocated leg once (``Hedge``, through ``start``) and returns
whichever comes first: the split leg's own result (its errors and deadlines included), or the
hedge once the colocated leg's first body bytes are in (the split leg is then closed, so the
engine aborts it). A hedge outlives the race it started in: one started beside the prefill
leg races the decode leg too. Whoever takes its answer ``adopt``s it; otherwise it is
``cancel``led (closed), at the latest when the call closes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from vllm_pd_ext.proxy.fleet import Instance, Lease
from vllm_pd_ext.proxy.upstream import UpstreamError, UpstreamResponse, discard

if TYPE_CHECKING:
    from vllm_pd_ext.proxy.call import Call
    from vllm_pd_ext.proxy.stall_guard import StallGuard

T = TypeVar("T")


class HedgeWon(Exception):
    """The hedge's colocated leg answered before the split's prefill leg did."""


class Hedge:
    """One colocated leg started beside a late split leg, with its instance's lease."""

    __slots__ = ("_ended", "adopted", "guard", "inst", "lease", "leg", "pair", "rescue", "task")

    def __init__(
        self,
        guard: StallGuard,
        inst: Instance,
        leg: str,
        pair: tuple[Instance | None, Instance],
        opening: Awaitable[UpstreamResponse],
        timeout_s: float,
    ):
        self.guard = guard
        self.inst = inst
        #: The split's leg that was late when it started (prefill, decode), and its
        #: prefill -> decode pair.
        self.leg = leg
        self.pair = pair
        self.lease = Lease(inst)
        #: Its response once its first body bytes came within ``timeout_s``; None past that.
        self.task: asyncio.Task[UpstreamResponse | None] = asyncio.ensure_future(
            _colocated(opening, timeout_s)
        )
        self.adopted = False
        #: The split failed or missed a deadline after it began (counted as that): its leg
        #: serving is then a rescue, not a win over the split.
        self.rescue = False
        self._ended = False

    @property
    def won(self) -> bool:
        """Are the colocated leg's first body bytes in?"""
        t = self.task
        return t.done() and not t.cancelled() and t.exception() is None and t.result() is not None

    @property
    def live(self) -> bool:
        """Is it running, or won and not yet taken?"""
        return not self._ended

    async def wait(self) -> UpstreamResponse | None:
        """The colocated leg's response once its first bytes are in; None when it failed
        (then it is over, counted ``failed``)."""
        await asyncio.wait((self.task,))
        if self.won:
            return self.task.result()
        self.cancel("failed")
        return None

    def adopt(self, outcome: str) -> tuple[UpstreamResponse, Lease]:
        """Take the won leg's response and lease: it serves the request now. ``outcome``:
        colocated (it beat the split), rescue (the split had failed or missed its deadline
        first)."""
        resp = self.task.result()
        assert resp is not None
        self.adopted = True
        self._end(outcome)
        return resp, self.lease

    def cancel(self, outcome: str) -> None:
        """Close the colocated leg (the engine aborts it), unless it was adopted or is over."""
        if self._ended:
            return
        self.task.cancel()
        self.task.add_done_callback(_close_result)
        self.lease.release()
        self._end(outcome)

    def _end(self, outcome: str) -> None:
        self._ended = True
        self.guard.hedge_end(self.leg, outcome, *self.pair)


async def _colocated(
    opening: Awaitable[UpstreamResponse], timeout_s: float
) -> UpstreamResponse | None:
    """A hedge's leg: its 200 response with its first body bytes in; None when it failed."""
    try:
        resp = await first_bytes(opening, timeout_s)
    except UpstreamError:
        return None
    if resp is not None and resp.status != 200:
        resp.close()
        return None
    return resp


def _close_result(task: asyncio.Task[UpstreamResponse | None]) -> None:
    if not task.cancelled() and task.exception() is None:
        resp = task.result()
        if resp is not None:
            resp.close()


async def race(
    call: Call,
    split: Awaitable[T],
    at: float,
    start: Callable[[], Hedge | None],
) -> T | Hedge:
    """``split``'s result, or the call's hedge if its colocated leg's first bytes come
    first (``split`` is then cancelled: the engine aborts it). The hedge is started by
    ``start`` (None: not now, e.g. at the in-flight bound) once ``time.perf_counter()``
    reaches ``at``, unless the call has one. A hedge that fails leaves ``split`` alone."""
    task = asyncio.ensure_future(split)
    try:
        if call.hedge is None:
            done, _ = await asyncio.wait((task,), timeout=max(0.0, at - time.perf_counter()))
            if done:
                return task.result()
            call.hedge = start()
        hedge = call.hedge
        if hedge is None or not hedge.live:
            return await task
        await asyncio.wait((task, hedge.task), return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        if hedge.won:
            await _cancel(task)
            return hedge
        hedge.cancel("failed")
        return await task
    except BaseException:
        await _cancel(task)
        raise


async def _cancel(task: asyncio.Future[Any]) -> None:
    """Cancel ``task``, closing what it returned if it already had (an upstream response)."""
    task.cancel()
    try:
        await asyncio.wait((task,))
    finally:
        if task.done() and not task.cancelled() and task.exception() is None:
            result = task.result()
            if isinstance(result, UpstreamResponse):
                result.close()


async def first_bytes(
    opening: Awaitable[UpstreamResponse], timeout: float
) -> UpstreamResponse | None:
    """``opening``'s response once it has answered and, if 200, its body's first bytes have
    come, all within ``timeout`` seconds; None past that, or when a 200 body ended or broke
    before any byte (what was opened is closed, so the engine aborts the request)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    task = asyncio.ensure_future(opening)
    try:
        done, _ = await asyncio.wait((task,), timeout=max(0.0, timeout))
    except BaseException:
        await discard(task)
        raise
    if not done:
        await discard(task)
        return None
    resp = task.result()  # its UpstreamError, as an unguarded leg's
    if resp.status != 200:
        return resp
    try:
        arrived = await resp.arrived(deadline - loop.time())
    except BaseException:
        resp.close()
        raise
    if not arrived or not resp.has_body_bytes:
        resp.close()
        return None
    return resp
