"""Admission for a listener's connections, so that nobody without a key can take all of them.

A listener that serves one thread per connection must bound them, and a bound alone is a
target: whoever opens that many connections and sends nothing (or one byte now and then) holds
every slot. :class:`ConnectionSlots` admits a connection only if the listener holds fewer than
``limit`` and its source address fewer than ``per_source``; gives each one a deadline for its
*head* (what it must send before anything can be authenticated: a request line and headers, a
notification frame); closes the connections whose head is late (:meth:`ConnectionSlots.expire`,
called from the listener's accept loop); and, when full, closes the oldest connection still in
its head to admit a new one. A peer that sends its head at once (every real client) is past it
within a round trip and cannot be closed that way; a connection that dawdles is the first to go.

"Close" here is ``shutdown(SHUT_RDWR)``: the thread reading that socket wakes up with end of
file and closes it itself (no other thread ever closes a socket it does not own). Threads are
bounded too: connections closed this way still count until their thread has released them, and
at most ``2 * limit`` connections are held in all.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable

from vllm_pd_ext.util.throttle import Throttle

logger = logging.getLogger(__name__)

#: Refused connections are logged at most this often.
WARN_EVERY_S = 10.0


class _Slot:
    __slots__ = ("closed", "deadline", "in_head", "sock", "source")

    def __init__(self, sock: socket.socket, source: str, deadline: float) -> None:
        self.sock, self.source, self.deadline = sock, source, deadline
        self.in_head = True
        self.closed = False  # shut down by us: late head, or evicted for a newer connection


class ConnectionSlots:
    """At most ``limit`` connections (``per_source`` from one address), each with
    ``head_timeout_s`` to send its head; connections are named by their sockets. ``what``
    names the listener in log lines. Thread-safe."""

    def __init__(
        self,
        what: str,
        limit: int,
        per_source: int,
        head_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if limit < 1 or per_source < 1:
            raise ValueError(f"{what}: limit={limit} and per_source={per_source} must be >= 1")
        self.what, self.limit, self.per_source = what, limit, min(per_source, limit)
        self.head_timeout_s = head_timeout_s
        self._clock = clock
        self._slots: dict[socket.socket, _Slot] = {}  # admitted, not yet released; oldest first
        self._open = 0  # of those, not closed by us
        self._by_source: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._warnings = Throttle(WARN_EVERY_S)
        #: Connections refused at admission, and connections closed by us (late head, evicted).
        self.refused = 0
        self.closed = 0

    def admit(self, sock: socket.socket, source: str) -> bool:
        """Whether a new connection from ``source`` may be served (if not, the caller closes
        it). May close the oldest connection still in its head to make room."""
        with self._lock:
            problem = None
            if self._by_source[source] >= self.per_source:
                problem = f"{self.per_source} connections from that address already"
            elif len(self._slots) >= 2 * self.limit:
                problem = f"{len(self._slots)} connections still closing"
            elif self._open >= self.limit:
                victim = next((s for s in self._slots.values() if s.in_head and not s.closed), None)
                if victim is None:
                    problem = f"{self.limit} connections already, none of them idle"
                else:
                    self._close(victim)
            if problem is None:
                self._slots[sock] = _Slot(sock, source, self._clock() + self.head_timeout_s)
                self._open += 1
                self._by_source[source] += 1
                return True
            self.refused += 1
            refused = self.refused
        if self._warnings.ready():  # a flood floods no log
            logger.warning(
                "%s: refused a connection from %s: %s (%d refused so far)",
                self.what,
                source,
                problem,
                refused,
            )
        return False

    def head_done(self, sock: socket.socket) -> bool:
        """Mark the head of ``sock``'s connection as received; False if we closed it first
        (then serve nothing on it: what was read may be cut short)."""
        with self._lock:
            slot = self._slots.get(sock)
            if slot is None:
                return False
            slot.in_head = False
            return not slot.closed

    def release(self, sock: socket.socket) -> None:
        """The thread serving ``sock`` is done with it (call once per admitted socket)."""
        with self._lock:
            slot = self._slots.pop(sock, None)
            if slot is None:
                return
            if not slot.closed:
                self._open -= 1
            self._by_source[slot.source] -= 1
            if not self._by_source[slot.source]:
                del self._by_source[slot.source]

    def expire(self) -> int:
        """Close every connection whose head is late; how many were closed."""
        now = self._clock()
        with self._lock:
            late = [
                s for s in self._slots.values() if s.in_head and not s.closed and s.deadline <= now
            ]
            for slot in late:
                self._close(slot)
        return len(late)

    def in_head(self) -> int:
        """Connections still sending their heads (and not closed by us)."""
        with self._lock:
            return sum(s.in_head and not s.closed for s in self._slots.values())

    def held(self) -> int:
        """Connections admitted and not yet released (those we closed included)."""
        with self._lock:
            return len(self._slots)

    def shutdown_all(self) -> None:
        """Shut down every connection not yet released (the listener is closing): each
        thread wakes up with end of file and releases its own."""
        with self._lock:
            for slot in self._slots.values():
                with contextlib.suppress(OSError):  # the peer is gone already
                    slot.sock.shutdown(socket.SHUT_RDWR)

    def _close(self, slot: _Slot) -> None:  # holding the lock
        slot.closed = True
        self._open -= 1
        self.closed += 1
        with contextlib.suppress(OSError):  # its thread closed it already
            slot.sock.shutdown(socket.SHUT_RDWR)
