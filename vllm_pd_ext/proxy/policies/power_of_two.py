"""Power of two choices: sample two candidates, take the less loaded."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING

from vllm_pd_ext.proxy.policies.base import C

if TYPE_CHECKING:
    from vllm_pd_ext.proxy.kv_events import Lookup


class PowerOfTwo:
    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def select(self, key: str, candidates: Sequence[C], prompt: Lookup | None = None) -> C:
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(list(candidates), 2)
        return a if a.load() <= b.load() else b
