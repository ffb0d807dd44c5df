"""The least-loaded candidate; ties rotate so equal instances share the work."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from vllm_pd_ext.proxy.policies.base import C

if TYPE_CHECKING:
    from vllm_pd_ext.proxy.kv_events import Lookup


class LeastLoaded:
    def __init__(self) -> None:
        self._counter = itertools.count()

    def select(self, key: str, candidates: Sequence[C], prompt: Lookup | None = None) -> C:
        start = next(self._counter) % len(candidates)
        rotated = [*candidates[start:], *candidates[:start]]
        return min(rotated, key=lambda c: c.load())
