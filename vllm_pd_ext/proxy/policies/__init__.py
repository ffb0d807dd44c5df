"""Routing policies, one module each, chosen by name separately for prefill and decode."""

from __future__ import annotations

from vllm_pd_ext.proxy.policies.base import Candidate, Policy
from vllm_pd_ext.proxy.policies.cache_aware import CacheAware, ScoringConfig
from vllm_pd_ext.proxy.policies.least_loaded import LeastLoaded
from vllm_pd_ext.proxy.policies.power_of_two import PowerOfTwo
from vllm_pd_ext.proxy.policies.prefix_affinity import PrefixAffinity
from vllm_pd_ext.proxy.policies.round_robin import RoundRobin

POLICIES: dict[str, type[Policy]] = {
    "round-robin": RoundRobin,
    "least-loaded": LeastLoaded,
    "power-of-two": PowerOfTwo,
    "prefix-affinity": PrefixAffinity,
    "cache-aware": CacheAware,
}


def make_policy(name: str, scoring: ScoringConfig | None = None) -> Policy:
    """A fresh policy object by its configured name (``scoring``: the weights of
    ``cache-aware``)."""
    if name == "cache-aware":
        return CacheAware(scoring)
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}") from None


__all__ = ["POLICIES", "Candidate", "Policy", "ScoringConfig", "make_policy"]
