"""Rate limits for log lines a peer can make us write at will (refused requests, dropped
connections): at most one per interval, whatever the rate of events behind it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Throttle:
    """:meth:`ready` is True at most once per ``every_s`` seconds. Thread-safe."""

    def __init__(self, every_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_s
        self._clock = clock
        self._last = float("-inf")
        self._lock = threading.Lock()

    def ready(self) -> bool:
        """Whether the interval since the last True has passed (and start a new one if so)."""
        now = self._clock()
        with self._lock:
            if now - self._last < self.every_s:
                return False
            self._last = now
            return True
