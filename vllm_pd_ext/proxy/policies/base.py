"""The policy seam: pick one instance among healthy candidates for one request."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    from vllm_pd_ext.proxy.kv_events import Lookup


class Candidate(Protocol):
    """What a policy may read about an instance."""

    @property
    def url(self) -> str: ...

    #: The engine's KV cache usage (0-1), from its ``/metrics``.
    kv_usage: float
    #: Health checks failed in a row (not yet ejected: healthy candidates only).
    failures: int

    def load(self) -> float:
        """Higher is busier: in-flight requests through this proxy plus the engine's queue."""
        ...

    def cached_tokens(self, prompt: Lookup) -> int | None:
        """How many of the prompt's leading tokens its prefix cache holds, from its KV
        events; None when it has no prefix index (the estimate stands in)."""
        ...


C = TypeVar("C", bound=Candidate)


class Policy(Protocol):
    def select(self, key: str, candidates: Sequence[C], prompt: Lookup | None = None) -> C:
        """Choose one of ``candidates`` (never empty) for a request whose affinity key is
        ``key`` (a prefix of its prompt) and whose token ids, when the proxy knows them, are
        ``prompt`` (for policies that look them up in the engines' prefix indexes). Runs on the
        proxy's event loop: must not block."""
        ...
