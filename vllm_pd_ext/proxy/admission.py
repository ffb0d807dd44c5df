"""Admission control: a bounded number in flight and a bounded, time-limited queue."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from vllm_pd_ext.proxy.errors import ProxyError
from vllm_pd_ext.util.aio import within


class Admission:
    """Hands out in-flight slots; callers ``release()`` each slot they ``acquire()``."""

    def __init__(
        self,
        max_in_flight: int,
        max_queued: int,
        queue_timeout_s: float,
        on_queued: Callable[[int], None] | None = None,
    ):
        self._slots = asyncio.Semaphore(max_in_flight)
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.queued = 0
        self.in_flight = 0
        #: Told the number queued whenever it changes (a request only queues when no slot
        #: is free: the common case never calls it).
        self._on_queued = on_queued or (lambda n: None)

    def refusal_now(self) -> ProxyError | None:
        """The 429 ``acquire()`` would raise at once (no slot free, the queue full), else
        None: asked before a request's body is read, so that a refused body is never held."""
        # the queue first: a number, where the semaphore's check is two Python calls
        if self.queued >= self.max_queued and self._slots.locked():
            return ProxyError(
                429, "proxy saturated: too many queued requests", code="queue_full", retry_after=1
            )
        return None

    async def acquire(self) -> None:
        """Wait for a slot. Raises 429 when the queue is full, 503 on queue timeout."""
        if self._slots.locked():
            refused = self.refusal_now()
            if refused is not None:
                raise refused
            self.queued += 1
            self._on_queued(self.queued)
            try:
                await within(
                    self._slots.acquire(), self.queue_timeout_s, lambda _: self._slots.release()
                )
            except asyncio.TimeoutError:
                raise ProxyError(
                    503,
                    "proxy saturated: timed out waiting for a slot",
                    code="queue_timeout",
                    retry_after=self.queue_timeout_s,
                ) from None
            finally:
                self.queued -= 1
                self._on_queued(self.queued)
        else:
            await self._slots.acquire()
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1
        self._slots.release()
