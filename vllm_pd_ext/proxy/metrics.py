"""The proxy's Prometheus metrics (``vllm_pd_`` prefix), in a registry of its own.

The types are the lock-free ones of ``metric_types`` (updated from the event loop only)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from vllm_pd_ext.proxy.metric_types import Counter, Gauge, Histogram

if TYPE_CHECKING:
    from vllm_pd_ext.proxy.fleet import Instance

#: Distinct prefill->decode pairs a pair-labelled metric keeps apart; the series of pairs
#: seen after them are counted together under ``OTHER`` (instances come and go with the
#: fleet: this bounds the series of a long-lived proxy).
MAX_PAIRS = 1024
#: The ``prefill`` and ``decode`` label of pairs beyond ``MAX_PAIRS``.
OTHER = "other"

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class ProxyMetrics:
    """All metric objects of one proxy app."""

    def child(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)``, remembered: the hot path asks for the same few
        children on every request."""
        key = (id(metric), values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
        return found

    def pair(
        self, metric: Any, prefill: Instance | None, decode: Instance | None, *values: str
    ) -> Any:
        """The child of a metric labelled ``prefill``, ``decode`` (then ``values``) for this
        pair of fleet instances ("-" for a side not known); remembered like :meth:`child`,
        for at most ``MAX_PAIRS`` pairs a metric (later ones: ``OTHER``)."""
        labels = (prefill.label if prefill else "-", decode.label if decode else "-", *values)
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            pairs = self._pairs.setdefault(id(metric), set())
            if labels[:2] not in pairs:
                if len(pairs) >= MAX_PAIRS:
                    return metric.labels(OTHER, OTHER, *values)
                pairs.add(labels[:2])
            found = self._children[key] = metric.labels(*labels)
        return found

    def __init__(self) -> None:
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._pairs: dict[int, set[tuple[str, ...]]] = {}
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "vllm_pd_requests",
            "Requests by route, decision and outcome",
            ["route", "decision", "outcome"],
            registry=r,
        )
        self.decisions = Counter(
            "vllm_pd_decisions",
            "Split-or-colocated decisions by reason",
            ["decision", "reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "vllm_pd_ttft_seconds",
            "Time to first token as the client sees it",
            ["route", "decision"],
            buckets=_LATENCY,
            registry=r,
        )
        self.itl = Histogram(
            "vllm_pd_itl_seconds",
            "Gap between streamed writes to the client (events that arrive together go together)",
            ["decision"],
            buckets=_ITL,
            registry=r,
        )
        self.prefill_leg = Histogram(
            "vllm_pd_prefill_leg_seconds",
            "Prefill leg, request sent to response received",
            buckets=_LATENCY,
            registry=r,
        )
        self.transfer_gap = Histogram(
            "vllm_pd_transfer_gap_seconds",
            "Prefill leg done to first decode token (KV transfer plus decode admission), by "
            "prefill -> decode pair",
            ["prefill", "decode"],
            buckets=_LATENCY,
            registry=r,
        )
        self.split_failures = Counter(
            "vllm_pd_split_failures",
            "Split requests that failed on their pair, by prefill -> decode pair and reason: "
            "stall (no first token by the stall guard's deadline), prefill_stall (the prefill "
            "leg past its deadline), decode_error (the decode instance failed the leg after "
            "the prefill leg), hedge (its hedge's colocated leg answered first); each was served "
            "another way",
            ["prefill", "decode", "reason"],
            registry=r,
        )
        self.retries = Counter("vllm_pd_retries", "Retries by leg", ["leg"], registry=r)
        self.fallbacks = Counter(
            "vllm_pd_fallbacks",
            "Split requests served colocated after a failure",
            ["reason"],
            registry=r,
        )
        self.hedges = Counter(
            "vllm_pd_hedges",
            "Late split streams hedged with a colocated leg, by the leg that was late (prefill, "
            "decode) and outcome: split or colocated (the leg that answered first; the other "
            "was closed), rescue (the colocated leg served after the split leg failed or "
            "missed its deadline), failed (the colocated leg missed its own deadline or "
            "failed), bound (not hedged: hedge_max_in_flight reached), abandoned (the client "
            "left)",
            ["leg", "outcome"],
            registry=r,
        )
        self.migrations = Counter(
            "vllm_pd_migrations",
            "Answers whose engine failed part-way, by what the proxy did: continued "
            "elsewhere, finished by the proxy, asked again (whole answers), or not moved "
            "(limit, unsupported, no_instance)",
            ["outcome"],
            registry=r,
        )
        self.derender_per_event = Counter(
            "vllm_pd_derender_per_event",
            "Streamed token-mode answers derendered with one render call per event instead "
            "of one streaming call, by reason",
            ["reason"],
            registry=r,
        )
        self.breaker_open = Gauge(
            "vllm_pd_breaker_open",
            "1 while the stall guard gives a prefill-decode pair no splits",
            ["prefill", "decode"],
            registry=r,
        )
        self.aborts = Counter(
            "vllm_pd_aborts", "Client disconnects by phase", ["phase"], registry=r
        )
        self.drains = Counter(
            "vllm_pd_drains",
            "Abandoned splits whose prefill KV was drained",
            ["outcome"],
            registry=r,
        )
        self.background_skipped = Counter(
            "vllm_pd_background_skipped",
            "Drains and aborts not run because the background task limit was reached",
            ["kind"],
            registry=r,
        )
        self.rejected = Counter(
            "vllm_pd_rejected", "Requests refused before routing", ["reason"], registry=r
        )
        self.in_flight = Gauge("vllm_pd_in_flight", "Requests being served", registry=r)
        self.queued = Gauge("vllm_pd_queued", "Requests waiting for admission", registry=r)
        self.upstream_healthy = Gauge(
            "vllm_pd_upstream_healthy",
            "1 when the instance passes health checks",
            ["instance", "role"],
            registry=r,
        )
        self.kv_events = Gauge(
            "vllm_pd_kv_events",
            "Per instance that publishes KV events: the prefix index's blocks, batches read, "
            "gaps in their sequence, restarts of the engine seen, events skipped (malformed, "
            "orphans, dropped), failed (1: the subscription stopped); instances without are "
            "routed on the estimate",
            ["instance", "figure"],
            registry=r,
        )
        self.cache_view = Gauge(
            "vllm_pd_cache_view",
            "1 for how the proxy knows what the instance's prefix cache holds: events (its KV "
            "events feed a prefix index) or estimate (prefix affinity: no events, or their "
            "subscription failed)",
            ["instance", "view"],
            registry=r,
        )
        self.lookups = Counter(
            "vllm_pd_prefix_lookups",
            "Requests routed by the cache-aware policy, by what it scored on: events (the "
            "prompt's token ids looked up in the prefix indexes), no_token_ids (a text prompt: "
            "the estimate), no_events (no candidate has an index: the estimate)",
            ["basis"],
            registry=r,
        )
        self.kv_room = Gauge(
            "vllm_pd_kv_room_blocks",
            "KV blocks free per instance as the split decision reckons it: its cache size and "
            "usage from its /metrics, less the splits routed there since (absent while its "
            "cache size is not known)",
            ["instance", "role"],
            registry=r,
        )
        self.room_waiting = Gauge(
            "vllm_pd_room_waiting",
            "Splits waiting for KV room on their decode instance (decode_room: wait)",
            registry=r,
        )
        self.room_waits = Counter(
            "vllm_pd_room_waits",
            "Splits that waited for KV room on their decode instance, by outcome: room (then "
            "routed again), timeout (served as routed last, colocated when still full)",
            ["outcome"],
            registry=r,
        )
        self.upstream_in_flight = Gauge(
            "vllm_pd_upstream_in_flight",
            "Requests this proxy has in flight per instance",
            ["instance", "role"],
            registry=r,
        )
