"""Round robin over the current candidates."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from vllm_pd_ext.proxy.policies.base import C

if TYPE_CHECKING:
    from vllm_pd_ext.proxy.kv_events import Lookup


class RoundRobin:
    def __init__(self) -> None:
        self._counter = itertools.count()

    def select(self, key: str, candidates: Sequence[C], prompt: Lookup | None = None) -> C:
        return candidates[next(self._counter) % len(candidates)]
