"""The policy seam: pick one instance among healthy candidates for one request."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar


class Candidate(Protocol):
    """What a policy may read about an instance."""

    @property
    def url(self) -> str: ...

    def load(self) -> float:
        """Higher is busier: in-flight requests through this proxy plus the engine's queue."""
        ...


C = TypeVar("C", bound=Candidate)


class Policy(Protocol):
    def select(self, key: str, candidates: Sequence[C]) -> C:
        """Choose one of ``candidates`` (never empty) for a request whose affinity key is
        ``key`` (a prefix of its prompt). Runs on the proxy's event loop: must not block."""
        ...
