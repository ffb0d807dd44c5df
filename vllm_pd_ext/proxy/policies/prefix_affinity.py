"""Prefix affinity: requests sharing a prompt prefix go where that prefix is cached.

Rendezvous (highest-random-weight) hashing over the candidates' URLs: a consistent hash, so
adding or removing an instance only moves the keys that hashed to it. An instance loaded more
than ``max_imbalance`` above the least-loaded candidate is skipped, so one hot prefix cannot
pile all traffic onto one engine.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from vllm_pd_ext.proxy.policies.base import C

if TYPE_CHECKING:
    from vllm_pd_ext.proxy.kv_events import Lookup


def weight(key: str, url: str) -> int:
    """The rendezvous weight of ``key`` on the instance at ``url`` (highest wins)."""
    digest = hashlib.blake2b(f"{url}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class PrefixAffinity:
    def __init__(self, max_imbalance: float = 8.0) -> None:
        self.max_imbalance = max_imbalance

    def select(self, key: str, candidates: Sequence[C], prompt: Lookup | None = None) -> C:
        floor = min(c.load() for c in candidates)
        ranked = sorted(candidates, key=lambda c: weight(key, c.url), reverse=True)
        for candidate in ranked:
            if candidate.load() - floor <= self.max_imbalance:
                return candidate
        return ranked[0]
