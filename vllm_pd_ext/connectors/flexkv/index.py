"""Scheduler-side index of one tier: which block keys it holds, where, and what to evict.

Entries are kept in least-recently-used order. An entry is *ready* (its bytes are there and
loadable) or *pending* (a save or promotion is in flight); pending and pinned entries (a load
reads them) are never evicted. Eviction is LRU with frequency awareness: among the
``window`` least-recently-used evictable entries, the one hit least often goes; the others
it passed over have their hit count halved, so a block that was hot once ages out.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class Entry:
    """One block in a tier."""

    slot: int
    ready: bool = False
    hits: int = 0
    pins: int = 0
    since: float = field(default_factory=time.monotonic)


class TierIndex:
    """Keys of one tier with fixed capacity (in blocks); ``slot`` numbers CPU pool rows."""

    def __init__(self, name: str, capacity: int, window: int = 8) -> None:
        self.name = name
        self.capacity = capacity
        self.window = max(1, window)
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._free = list(range(capacity - 1, -1, -1))
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> Entry | None:
        return self._entries.get(key)

    def ready(self, key: str) -> Entry | None:
        """The entry when its bytes are loadable, else None."""
        e = self._entries.get(key)
        return e if e is not None and e.ready else None

    def touch(self, key: str) -> None:
        """Count a hit and make ``key`` most recently used."""
        e = self._entries.get(key)
        if e is not None:
            e.hits += 1
            self._entries.move_to_end(key)

    def pin(self, key: str) -> None:
        self._entries[key].pins += 1

    def unpin(self, key: str) -> None:
        e = self._entries.get(key)
        if e is not None and e.pins > 0:
            e.pins -= 1

    def _victim(self) -> str | None:
        scanned: list[Entry] = []
        best: str | None = None
        best_hits = -1
        for key, e in self._entries.items():
            if e.pins or not e.ready:
                continue
            if best is None or e.hits < best_hits:
                best, best_hits = key, e.hits
            scanned.append(e)
            if len(scanned) >= self.window:
                break
        for e in scanned:
            e.hits //= 2
        return best

    def add(self, key: str, *, ready: bool) -> tuple[Entry | None, list[str]]:
        """Insert ``key`` (most recently used), evicting as needed.

        Returns the new entry (None when everything is pinned or pending, or the tier has no
        capacity) and the keys evicted to make room.
        """
        assert key not in self._entries, key
        evicted: list[str] = []
        while not self._free:
            victim = self._victim()
            if victim is None:
                return None, evicted
            self._free.append(self._entries.pop(victim).slot)
            evicted.append(victim)
            self.evictions += 1
        e = Entry(slot=self._free.pop(), ready=ready)
        self._entries[key] = e
        return e, evicted

    def mark_ready(self, key: str) -> None:
        e = self._entries.get(key)
        if e is not None:
            e.ready = True

    def remove(self, key: str) -> Entry | None:
        e = self._entries.pop(key, None)
        if e is not None:
            self._free.append(e.slot)
        return e

    def pending_older_than(self, age_s: float) -> list[str]:
        """Pending, unpinned keys whose save started more than ``age_s`` ago."""
        cutoff = time.monotonic() - age_s
        return [
            k for k, e in self._entries.items() if not e.ready and not e.pins and e.since < cutoff
        ]

    def clear(self) -> list[str]:
        """Drop every unpinned entry (pinned ones are in use by a load); return dropped keys."""
        dropped = [k for k, e in self._entries.items() if not e.pins]
        for k in dropped:
            self.remove(k)
        return dropped

    def keys(self) -> list[str]:
        return list(self._entries)
