"""Leases on prefill-side blocks: held until the decode side is done or stops renewing."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable


class LeaseTable:
    """Request id -> expiry time, and the peers that claimed the blocks to read them.

    A lease has reader **slots** (one unless the first claim names more: under tensor
    parallelism of different sizes, several decode ranks read one prefill rank's blocks); the
    first claim of each slot stands, and the blocks are released once every slot's holder said
    done or a reader that never claimed its slot closed it (or at once when nobody claimed
    any). A closed slot has no holder: nobody may claim it later, nor renew through it. The
    first claimant may name its engine id (what
    an expired lease is counted under). Not thread-safe: the caller holds one lock
    around every call.

    ``clock`` is injectable so tests can expire leases without sleeping.
    """

    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_s = lease_s
        self._clock = clock
        self._expiry: dict[str, float] = {}
        self._slots: dict[str, frozenset[Hashable]] = {}
        self._claims: dict[str, dict[Hashable, str]] = {}
        self._done: dict[str, set[Hashable]] = {}
        #: slots closed unclaimed (their reader failed before its claim): nobody holds them
        self._closed: dict[str, set[Hashable]] = {}
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

    def claim(
        self,
        req_id: str,
        peer: str,
        slot: Hashable = None,
        slots: Iterable[Hashable] | None = None,
        engine: str | None = None,
    ) -> str | None:
        """The peer ``slot`` of the held blocks of ``req_id`` belongs to once ``peer`` claims
        it (the first claim of a slot stands); None if ``req_id`` holds no lease. The first
        claim fixes the slots (``slots``, by default its own slot alone) and the engine id
        (``engine``, as the claimant named it); ``ValueError`` for a slot outside them, or one
        closed unclaimed."""
        if req_id not in self._expiry:
            return None
        expected = self._slots.setdefault(req_id, frozenset([slot] if slots is None else slots))
        if slot not in expected:
            raise ValueError(f"the blocks of {req_id} are leased to other readers")
        if slot in self._closed.get(req_id, ()):
            raise ValueError(f"that reader's slot of the blocks of {req_id} was closed unread")
        self._engine.setdefault(req_id, engine)
        return self._claims.setdefault(req_id, {}).setdefault(slot, peer)

    def holders(self, req_id: str) -> set[str]:
        """The peers that claimed the blocks of ``req_id`` (empty: nobody yet, or no lease)."""
        return set(self._claims.get(req_id, {}).values())

    def holder(self, req_id: str) -> str | None:
        """The first peer that claimed the blocks of ``req_id`` (None: nobody yet, or no
        lease)."""
        return next(iter(self._claims.get(req_id, {}).values()), None)

    def unclaimed(self, req_id: str, slot: Hashable) -> bool:
        """Whether ``slot`` is one of the slots the first claim of ``req_id`` fixed, nobody
        claimed it yet, and nobody closed it."""
        return (
            slot in self._slots.get(req_id, ())
            and slot not in self._claims.get(req_id, {})
            and slot not in self._closed.get(req_id, ())
        )

    def done(self, req_id: str, peer: str, slot: Hashable = None) -> bool:
        """``peer`` read what it claimed of ``req_id``, or is done with it unread (it failed,
        or its request ended, before it could claim); naming a ``slot`` nobody claimed, it
        closes that slot (done, with no holder: a reader that failed before its claim; ``peer``
        gains nothing there). True once that released the lease (every slot done or closed,
        or nobody had claimed any)."""
        if req_id not in self._expiry:
            return False
        claims = self._claims.get(req_id)
        if not claims:
            return self.release(req_id)
        finished = self._done.setdefault(req_id, set())
        if self.unclaimed(req_id, slot):
            self._closed.setdefault(req_id, set()).add(slot)
            finished.add(slot)
        finished.update(s for s, p in claims.items() if p == peer)
        if finished >= self._slots[req_id]:
            return self.release(req_id)
        return False

    def release(self, req_id: str) -> bool:
        """Drop the lease; True if it was held."""
        self._forget(req_id)
        return self._expiry.pop(req_id, None) is not None

    def _forget(self, req_id: str) -> None:
        self._slots.pop(req_id, None)
        self._claims.pop(req_id, None)
        self._done.pop(req_id, None)
        self._closed.pop(req_id, None)
        self._engine.pop(req_id, None)

    def expired(self) -> dict[str, str | None]:
        """Remove every lease past its expiry; return their request ids, each with the engine
        id its first claimant named (None: nobody claimed it, or named none)."""
        now = self._clock()
        gone = [r for r, t in self._expiry.items() if t <= now]
        engines = {r: self._engine.get(r) for r in gone}
        for r in gone:
            del self._expiry[r]
            self._forget(r)
        return engines

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._expiry

    def __len__(self) -> int:
        return len(self._expiry)
