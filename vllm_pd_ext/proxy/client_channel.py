"""The client's side of one request: noticing a disconnect, and streaming the answer back.

Both are built to cost little per request (they sit on the proxy's hot path): one watcher task
per request, which on a disconnect cancels whatever the request's task is awaiting at that
moment, instead of a task pair and ``asyncio.wait`` per awaited step or a task group per
stream (Starlette's ``StreamingResponse``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from vllm_pd_ext.proxy.front_protocol import DirectWriter, hooked_cycle
from vllm_pd_ext.proxy.request import ClientRequest

T = TypeVar("T")

#: The last event of an OpenAI-style stream.
STREAM_END = b"data: [DONE]\n\n"


class ClientGone(Exception):
    """The client disconnected while the proxy was waiting on an engine."""

    def __init__(self, phase: str):
        super().__init__(phase)
        self.phase = phase


class DisconnectWatch:
    """Watches one request's ASGI channel for the client going away.

    One long-lived watcher per request (a one-shot ``is_disconnected()`` can miss a disconnect
    while the server has paused reading the socket): under ``FrontProtocol`` the
    protocol's ``connection_lost`` itself, elsewhere a task reading the channel. While the
    request's task is inside ``race`` or a ``RelayResponse``, a disconnect cancels that task;
    elsewhere it only sets ``gone``. ``stop()`` it once the answer is complete: the server
    then reports the channel as disconnected.
    """

    def __init__(
        self,
        request: ClientRequest,
        *,
        hooked: bool = True,
        loop: asyncio.AbstractEventLoop | None = None,
    ):
        # the request's loop (``loop``: the running one, as its caller knows it): asking
        # asyncio for it costs a getpid() system call each time on Python 3.11
        self._loop = loop if loop is not None else asyncio.get_running_loop()
        self.gone = asyncio.Event()
        self._target: asyncio.Task | None = None
        self._cancelled = False
        self._stopped = False
        self._task: asyncio.Future | None
        cycle = self.cycle = hooked_cycle(request.receive) if hooked else None
        if cycle is not None:
            # Our protocol tells us itself (``FrontProtocol.connection_lost``): no
            # watcher task to create, start and wake at the end of every request.
            cycle.pdx_watch = self
            if cycle.disconnected:
                self.gone.set()
            self._task = None
        else:
            self._task = asyncio.ensure_future(self._watch(request))

    def _client_gone(self) -> None:
        if self._stopped:
            return
        self.gone.set()
        if self._target is not None:
            self._cancelled = True
            self._target.cancel()

    async def _watch(self, request: ClientRequest) -> None:
        while True:
            message = await request.receive()
            if self._stopped:
                return
            if message["type"] == "http.disconnect":
                self._client_gone()
                return

    def _arm(self) -> None:
        """From now on a disconnect cancels the current task (until ``_disarm``). A pair of
        calls, not a context manager: this runs twice per request on the hot path."""
        self._target, self._cancelled = asyncio.current_task(self._loop), False

    def _disarm(self) -> None:
        self._target = None

    def _ours(self) -> bool:
        """Was the cancellation being handled ours? Then take it back (Python 3.11+)."""
        if not self._cancelled:
            return False
        self._cancelled = False
        task = asyncio.current_task(self._loop)
        if task is not None and hasattr(task, "uncancel"):
            task.uncancel()
        return True

    async def race(self, work: Awaitable[T], phase: str) -> T:
        """Await ``work``; if the client disconnects first, cancel it and raise ClientGone.

        ``work`` is a coroutine (run in the calling task, cancelled on a disconnect) or a
        future (a task already running; when it finishes as the client leaves, its result
        wins, so a response it opened is not lost unclosed).
        """
        if isinstance(work, asyncio.Future):
            return await self._race_future(work, phase)
        if self.gone.is_set():
            work.close()  # type: ignore[attr-defined]
            raise ClientGone(phase)
        self._arm()
        try:
            return await work
        except asyncio.CancelledError:
            if self._ours():
                raise ClientGone(phase) from None
            raise
        finally:
            self._disarm()

    async def _race_future(self, fut: asyncio.Future, phase: str) -> T:
        gone = asyncio.ensure_future(self.gone.wait())
        try:
            done, _ = await asyncio.wait({fut, gone}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            fut.cancel()
            raise
        finally:
            gone.cancel()
        if fut in done:
            return fut.result()
        fut.cancel()
        await asyncio.wait((fut,))  # a cancellation of the caller itself propagates
        if not fut.cancelled() and fut.exception() is None:
            close = getattr(fut.result(), "close", None)
            if close is not None:
                close()  # what it opened as the client left (a response) is not kept
        raise ClientGone(phase)

    def stop(self) -> None:
        """Stop acting on what the channel says. A watcher task is not cancelled (a
        cancelled task leaves a reference cycle for the collector, per request): it ends
        when the server next wakes it, once the response is complete or the connection
        closes."""
        self._target = None
        self._stopped = True


class RelayResponse:
    """An ASGI response streaming ``body``, its head sent with the first chunk; a client
    disconnect ends it quietly.

    The body generator sees the disconnect as a cancellation at whatever it awaits (it then
    aborts its upstream request and records the outcome); this response swallows that
    cancellation. Always closes ``body`` and stops ``watch``.

    ``direct``: an object whose ``writer`` attribute this response sets to a
    ``DirectWriter`` once the head is out (None where there is none), so that the body's
    source may write parts itself, ahead of the generator, between its yields. A writer
    already there (``DirectWriter.before_start``) may have started the response before this
    runs: then the head is not sent again.
    """

    def __init__(
        self,
        body: AsyncIterator[bytes],
        watch: DisconnectWatch,
        headers: list[tuple[bytes, bytes]],
        direct=None,
    ):
        self._body = body
        self._watch = watch
        self._direct = direct
        self._headers = headers  # the response's, content type included

    async def __call__(self, scope, receive, send) -> None:
        watch = self._watch
        direct = self._direct
        done = started = offered = False
        start = {"type": "http.response.start", "status": 200, "headers": self._headers}
        try:
            watch._arm()
            try:
                async for chunk in self._body:
                    if done:
                        continue  # nothing follows the end of an OpenAI stream
                    if not started:
                        # The head goes with the first event (one write, see
                        # front_protocol), not ahead of it on its own.
                        started = True
                        if not _started_direct(direct):
                            await send(start)
                    if chunk.endswith(STREAM_END):
                        # The last event and the end of the response in one write.
                        watch.stop()  # the server now reads as disconnected to the watch
                        done = True
                    await send({"type": "http.response.body", "body": chunk, "more_body": not done})
                    if not offered and not done and direct is not None:
                        offered = True  # the head is out: later parts may go direct
                        direct.writer = DirectWriter.for_send(send)
            except asyncio.CancelledError:
                if watch._ours():
                    return
                raise
            finally:
                watch._disarm()
            if not done:
                watch.stop()
                if not started and not _started_direct(direct):
                    await send(start)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            if direct is not None:
                direct.writer = None
            watch.stop()
            await self._body.aclose()  # type: ignore[attr-defined]


def _started_direct(direct) -> bool:
    """Did the body's source start the response itself (``DirectWriter.before_start``)?"""
    writer = getattr(direct, "writer", None)
    return writer is not None and writer.started
