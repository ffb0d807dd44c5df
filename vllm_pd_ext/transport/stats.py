"""Counters for bytes, spans, seconds and failures of every transfer, kept in one place.

:class:`~vllm_pd_ext.transport.base.Transport` records each transfer here exactly once, when
it reaches a final state; backends never touch the counters. A connector turns
:meth:`TransferStats.take` (what happened since the last call) into vLLM connector stats and
Prometheus metrics; :meth:`TransferStats.totals` gives the running totals.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

#: At most this many per-transfer durations are kept between two ``take()`` calls.
MAX_KEPT_DURATIONS = 10_000


@dataclass
class StatsSnapshot:
    """Counters over one interval (``take``) or since the transport started (``totals``)."""

    transfers: int = 0
    failures: int = 0
    timeouts: int = 0
    bytes: int = 0
    spans: int = 0
    posted_spans: int = 0
    seconds: float = 0.0
    notifications_sent: int = 0
    notifications_received: int = 0
    #: Peers' reads and writes this transport refused for want of a grant (``enforce_grants``).
    ungranted: int = 0
    #: Seconds of each successful transfer in the interval (empty in ``totals``), oldest first.
    durations: list[float] = field(default_factory=list)

    @property
    def gbps(self) -> float:
        """Bytes of successful transfers per second spent in them, in GB/s (0 if none)."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, float | int | list[float]]:
        """Plain dict, e.g. for vLLM's ``KVConnectorStats.data`` or a JSON log line."""
        return {
            "transfers": self.transfers,
            "failures": self.failures,
            "timeouts": self.timeouts,
            "bytes": self.bytes,
            "spans": self.spans,
            "posted_spans": self.posted_spans,
            "seconds": self.seconds,
            "notifications_sent": self.notifications_sent,
            "notifications_received": self.notifications_received,
            "ungranted": self.ungranted,
            "durations": list(self.durations),
        }


class TransferStats:
    """Thread-safe counters; one instance per transport."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._interval = StatsSnapshot()
        self._totals = StatsSnapshot()

    def record_transfer(
        self, *, nbytes: int, spans: int, posted_spans: int, seconds: float, ok: bool
    ) -> None:
        """Count one finished transfer (success or failure). Called by the transport only."""
        with self._lock:
            for s in (self._interval, self._totals):
                if ok:
                    s.transfers += 1
                    s.bytes += nbytes
                    s.spans += spans
                    s.posted_spans += posted_spans
                    s.seconds += seconds
                else:
                    s.failures += 1
            if ok and len(self._interval.durations) < MAX_KEPT_DURATIONS:
                self._interval.durations.append(seconds)

    def record_timeout(self) -> None:
        """Count one wait that ran out (the transfer itself may still finish)."""
        with self._lock:
            self._interval.timeouts += 1
            self._totals.timeouts += 1

    def record_notification(self, *, sent: int = 0, received: int = 0) -> None:
        """Count notifications sent to or received from peers."""
        with self._lock:
            for s in (self._interval, self._totals):
                s.notifications_sent += sent
                s.notifications_received += received

    def record_ungranted(self) -> None:
        """Count one peer's read or write refused because nothing granted it."""
        with self._lock:
            self._interval.ungranted += 1
            self._totals.ungranted += 1

    def take(self) -> StatsSnapshot:
        """Return the counters since the previous ``take()`` and start a new interval."""
        with self._lock:
            snap, self._interval = self._interval, StatsSnapshot()
        return snap

    def totals(self) -> StatsSnapshot:
        """Return a copy of the running totals (no durations)."""
        with self._lock:
            t = self._totals
            return StatsSnapshot(
                transfers=t.transfers,
                failures=t.failures,
                timeouts=t.timeouts,
                bytes=t.bytes,
                spans=t.spans,
                posted_spans=t.posted_spans,
                seconds=t.seconds,
                notifications_sent=t.notifications_sent,
                notifications_received=t.notifications_received,
                ungranted=t.ungranted,
            )
