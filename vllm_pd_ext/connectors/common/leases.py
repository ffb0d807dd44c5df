"""Leases on prefill-side blocks: held until the decode side is done or stops renewing."""

from __future__ import annotations

import time
from collections.abc import Callable


class LeaseTable:
    """Request id -> expiry time, and the peer that claimed the blocks (the first to say it
    reads them) with the engine id it named. Not thread-safe: the caller holds one lock
    around every call.

    ``clock`` is injectable so tests can expire leases without sleeping.
    """

    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_s = lease_s
        self._clock = clock
        self._expiry: dict[str, float] = {}
        self._holder: dict[str, str] = {}
        self._engine: dict[str, str | None] = {}

    def grant(self, req_id: str, lease_s: float | None = None) -> None:
        """Start (or restart) the lease of ``req_id``."""
        self._expiry[req_id] = self._clock() + (self.lease_s if lease_s is None else lease_s)

    def renew(self, req_id: str) -> bool:
        """Extend a held lease; False if ``req_id`` holds none (already freed or unknown)."""
        if req_id not in self._expiry:
            return False
        self._expiry[req_id] = self._clock() + self.lease_s
        return True

    def claim(self, req_id: str, peer: str, engine: str | None = None) -> str | None:
        """The peer the held blocks of ``req_id`` belong to once ``peer`` (of engine id
        ``engine``, if it named one) claims them (the first claim stands); None if ``req_id``
        holds no lease."""
        if req_id not in self._expiry:
            return None
        if req_id not in self._holder:
            self._holder[req_id] = peer
            self._engine[req_id] = engine
        return self._holder[req_id]

    def holder(self, req_id: str) -> str | None:
        """Who claimed the blocks of ``req_id`` (None: nobody yet, or no lease)."""
        return self._holder.get(req_id)

    def release(self, req_id: str) -> bool:
        """Drop the lease; True if it was held."""
        self._holder.pop(req_id, None)
        self._engine.pop(req_id, None)
        return self._expiry.pop(req_id, None) is not None

    def expired(self) -> dict[str, str | None]:
        """Remove every lease past its expiry; return their request ids, each with the engine
        id its claimant named (None: nobody claimed it, or named none)."""
        now = self._clock()
        gone = [r for r, t in self._expiry.items() if t <= now]
        for r in gone:
            del self._expiry[r]
            self._holder.pop(r, None)
        return {r: self._engine.pop(r, None) for r in gone}

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._expiry

    def __len__(self) -> int:
        return len(self._expiry)
