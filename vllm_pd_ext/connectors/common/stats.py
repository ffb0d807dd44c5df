"""Transfer statistics of our P/D connectors, through vLLM's connector stats and metrics hooks.

The worker fills a :class:`PdTransferStats` (``get_kv_connector_stats``); vLLM ships its
``data`` to the engine's logger, aggregates, logs a summary line and feeds
:class:`PdTransferPromMetrics`, which exports these on the engine's own ``/metrics``:

* ``vllm:pdext_kv_transfer_seconds`` / ``vllm:pdext_kv_transfer_bytes`` histograms, one
  observation per finished transfer (either direction);
* ``vllm:pdext_kv_transfer_failures_total``, ``vllm:pdext_kv_lease_expiries_total`` counters;
* ``vllm:pdext_kv_unauthenticated_total``: side-channel requests and data connections refused
  for want of a valid fleet-key tag;
* ``vllm:pdext_kv_params_refused_total``: decode requests whose ``kv_transfer_params`` were
  refused on arrival (malformed, unsigned or tampered with, expired, another contract
  version; counted by the scheduler side), or whose WRITE KV arrived computed for another
  prompt (counted by the worker side): each was computed locally instead;
* ``vllm:pdext_kv_ungranted_total``: peers' reads and writes of our KV memory refused because
  they reached beyond the blocks leased or offered to them (backends that enforce grants);
* ``vllm:pdext_kv_transport_fallbacks_total``: connections to peers over which the transport
  backend moves payloads by a slower path than its own (``cma``: over the socket, not by
  cross-memory attach; the reason is in the engine's log);
* ``vllm:pdext_kv_blocks_held`` gauge: prefill-side blocks held for decode instances;
* per peer engine (label ``peer``: the remote engine's vLLM engine id, ``unknown`` when
  nobody is known, ``other`` while :data:`MAX_PEERS` peers active within :data:`PEER_IDLE_S`
  hold labels; an idle peer's series are removed to make room), counters of the transfers
  this engine ran with it (``vllm:pdext_kv_peer_transfers_total``), their bytes
  (``..._peer_bytes_total``) and seconds (``..._peer_transfer_seconds_total``), the failed
  ones (``..._peer_transfer_failures_total``) and the leases it let expire
  (``..._peer_lease_expiries_total``);
* ``vllm:pdext_kv_engine_info{engine_id}`` = 1: this engine's own id, to join a ``peer`` to
  the instance that exports it.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from contextlib import suppress
from functools import partial
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

_LISTS = ("seconds", "bytes")
_COUNTERS = (
    "failures",
    "lease_expiries",
    "unauthenticated",
    "params_refused",
    "ungranted",
    "fallbacks",
)


#: Per peer engine: field of a peer's row in ``data["peers"]`` -> (counter, its help text).
_PEER_METRICS = {
    "transfers": (
        "vllm:pdext_kv_peer_transfers",
        "KV transfers this engine completed with a peer engine (one per worker).",
    ),
    "bytes": (
        "vllm:pdext_kv_peer_bytes",
        "Bytes of the KV transfers this engine completed with a peer engine.",
    ),
    "seconds": (
        "vllm:pdext_kv_peer_transfer_seconds",
        "Seconds of the KV transfers this engine completed with a peer engine.",
    ),
    "failures": (
        "vllm:pdext_kv_peer_transfer_failures",
        "KV transfers with a peer engine that failed or timed out.",
    ),
    "lease_expiries": (
        "vllm:pdext_kv_peer_lease_expiries",
        "Prefill-side leases that expired unrenewed, by the decode engine that had claimed "
        "the blocks (unknown: none had).",
    ),
}
#: Distinct peer engines one engine labels its per-peer counters with at once; the rest are
#: "other", so that whoever reaches an engine cannot grow its series without bound.
MAX_PEERS = 64
#: Seconds without a transfer after which a peer's label may give its place to a new peer (its
#: series removed). vLLM's engine ids are new at every start, so a long-lived prefill sees a
#: new id per decode restart: without this, every peer after the 64th would read as "other".
PEER_IDLE_S = 600.0
UNKNOWN_PEER = "unknown"
OTHER_PEER = "other"
#: The longest peer id kept (vLLM's are uuids, with ``_dp<rank>`` under data parallelism).
_PEER_ID_CHARS = 128


class PeerLabels:
    """The ``peer`` label of a remote engine id: itself while fewer than ``limit`` others hold
    a label, ``other`` when all ``limit`` labels are held by peers seen within ``idle_s``,
    ``unknown`` for none. A new peer takes the place of the one idle longest once that one has
    been idle ``idle_s``; ``on_evict`` is then called with the evicted id. ``limit`` and
    ``idle_s`` default to :data:`MAX_PEERS` and :data:`PEER_IDLE_S`. Not thread-safe."""

    def __init__(
        self,
        limit: int | None = None,
        idle_s: float | None = None,
        on_evict: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit = MAX_PEERS if limit is None else limit
        self.idle_s = PEER_IDLE_S if idle_s is None else idle_s
        self._on_evict = on_evict
        self._clock = clock
        #: peer -> when it was last labelled, the longest idle first
        self._seen: OrderedDict[str, float] = OrderedDict()

    def __call__(self, peer: str | None) -> str:
        if not peer:
            return UNKNOWN_PEER
        peer = str(peer)[:_PEER_ID_CHARS]
        if peer in (UNKNOWN_PEER, OTHER_PEER):
            return peer
        now = self._clock()
        if peer in self._seen:
            self._seen[peer] = now
            self._seen.move_to_end(peer)
            return peer
        if len(self._seen) >= self.limit:
            oldest, seen_at = next(iter(self._seen.items()))
            if now - seen_at < self.idle_s:
                return OTHER_PEER
            del self._seen[oldest]
            if self._on_evict is not None:
                self._on_evict(oldest)
        self._seen[peer] = now
        return peer


def _empty() -> dict[str, Any]:
    return {
        "seconds": [],
        "bytes": [],
        **dict.fromkeys(_COUNTERS, 0),
        "blocks_held": None,
        "peers": {},
    }


def _add_peer(
    peers: dict[str, dict[str, int | float]], label: str, row: Mapping[str, int | float]
) -> None:
    """Add ``row`` (per-peer fields) to ``peers[label]``."""
    mine = peers.setdefault(label, dict.fromkeys(_PEER_METRICS, 0))
    for k in _PEER_METRICS:
        mine[k] += row.get(k, 0)


def engine_info_id(vllm_config: Any, engine_idx: int) -> str | None:
    """The engine id the connector of engine ``engine_idx`` works under: the configured one,
    with ``_dp<rank>`` appended under data parallelism (as vLLM's engine core does); None
    without a KV transfer config."""
    if vllm_config.kv_transfer_config is None:
        return None
    engine_id = str(vllm_config.kv_transfer_config.engine_id)
    if vllm_config.parallel_config.data_parallel_size > 1:
        return f"{engine_id}_dp{engine_idx}"
    return engine_id


class PdTransferStats(KVConnectorStats):
    """Serializable stats of one interval (``data`` is a plain dict)."""

    data: dict[str, Any]  # KVConnectorStats' field

    def __post_init__(self) -> None:
        if not self.data:
            self.data = _empty()

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        o = other.data
        for k in _LISTS:
            self.data[k] = list(self.data.get(k, [])) + list(o.get(k, []))
        for k in _COUNTERS:
            self.data[k] = self.data.get(k, 0) + o.get(k, 0)
        if o.get("blocks_held") is not None:
            self.data["blocks_held"] = o["blocks_held"]
        # workers (TP ranks) and intervals: each side bounded, so is their sum
        peers = {p: dict(row) for p, row in self.data.get("peers", {}).items()}
        labels = PeerLabels(MAX_PEERS, idle_s=float("inf"))  # one sum: nothing ages
        for p in list(peers):
            if labels(p) != p:  # beyond the bound already: fold into "other"
                _add_peer(peers, OTHER_PEER, peers.pop(p))
        for p, row in o.get("peers", {}).items():
            _add_peer(peers, labels(p), row)
        self.data["peers"] = peers
        return self

    def reduce(self) -> dict[str, int | float]:
        secs, sizes = self.data.get("seconds", []), self.data.get("bytes", [])
        total_s = sum(secs)
        out: dict[str, int | float] = {
            "transfers": len(secs),
            "MB": round(sum(sizes) / 1e6, 3),
            "avg_ms": round(1e3 * total_s / len(secs), 3) if secs else 0.0,
            "GB/s": round(sum(sizes) / total_s / 1e9, 3) if total_s > 0 else 0.0,
            **{k: self.data.get(k, 0) for k in _COUNTERS},
        }
        if self.data.get("peers"):
            out["peers"] = len(self.data["peers"])
        if self.data.get("blocks_held") is not None:
            out["blocks_held"] = self.data["blocks_held"]
        return out

    def is_empty(self) -> bool:
        d = self.data
        return not any(d.get(k) for k in (*_LISTS, *_COUNTERS, "peers"))


class StatsRecorder:
    """Thread-safe accumulator the worker's transfer threads write into."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = _empty()
        self._held: int | None = None
        self._peer_labels = PeerLabels()

    def _peer(self, peer: str | None, **row: int | float) -> None:
        """Count ``row`` for ``peer`` (an engine id; None: not known). Under the lock."""
        _add_peer(self._data["peers"], self._peer_labels(peer), row)

    def transfer(self, seconds: float, nbytes: int, peer: str | None = None) -> None:
        """A transfer of ``nbytes`` done in ``seconds``, with engine ``peer``."""
        with self._lock:
            self._data["seconds"].append(float(seconds))
            self._data["bytes"].append(int(nbytes))
            self._peer(peer, transfers=1, bytes=int(nbytes), seconds=float(seconds))

    def failure(self, peer: str | None = None) -> None:
        """A transfer with engine ``peer`` failed or timed out."""
        with self._lock:
            self._data["failures"] += 1
            self._peer(peer, failures=1)

    def lease_expired(self, peer: str | None = None) -> None:
        """A lease expired unrenewed; ``peer``: the engine that had claimed its blocks."""
        with self._lock:
            self._data["lease_expiries"] += 1
            self._peer(peer, lease_expiries=1)

    def refused(self) -> None:
        """A side-channel request or data connection without a valid fleet-key tag."""
        with self._lock:
            self._data["unauthenticated"] += 1

    def params_refused(self) -> None:
        """A decode request's ``kv_transfer_params`` refused, or the KV a WRITE wrote for it
        (computed for another prompt): it is computed locally."""
        with self._lock:
            self._data["params_refused"] += 1

    def ungranted(self) -> None:
        """A peer's read or write of our memory outside what was granted to it."""
        with self._lock:
            self._data["ungranted"] += 1

    def fallback(self) -> None:
        """A connection to a peer whose payloads go by the backend's slower path."""
        with self._lock:
            self._data["fallbacks"] += 1

    def blocks_held(self, n: int) -> None:
        with self._lock:
            if n != self._held:
                self._held = n
                self._data["blocks_held"] = n

    def take(self) -> PdTransferStats | None:
        """The interval's stats (None when nothing happened), then start a new interval."""
        with self._lock:
            data, self._data = self._data, _empty()
        stats = PdTransferStats(data=data)
        if stats.is_empty() and data["blocks_held"] is None:
            return None
        return stats


class PdTransferPromMetrics(KVConnectorPromMetrics):
    """Our connectors' Prometheus metrics (registered by vLLM through build_prom_metrics)."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        #: field -> counter labelled by engine and ``peer`` (children made as peers appear)
        self.peer_counters = {
            field: self._counter_cls(name=name, documentation=doc, labelnames=[*labelnames, "peer"])
            for field, (name, doc) in _PEER_METRICS.items()
        }
        # Several API servers (prometheus_client's multi-process mode) cannot remove a
        # series: there no peer ages out, so the series stay bounded.
        idle_s = float("inf") if "PROMETHEUS_MULTIPROC_DIR" in os.environ else None
        self._peer_labels = {
            idx: PeerLabels(idle_s=idle_s, on_evict=partial(self._remove_peer, values))
            for idx, values in per_engine_labelvalues.items()
        }
        for values in per_engine_labelvalues.values():
            for counter in self.peer_counters.values():
                counter.labels(*values, UNKNOWN_PEER)  # declared with a series from the start
        info = self._gauge_cls(
            name="vllm:pdext_kv_engine_info",
            documentation="1, labelled with the engine id this engine's connector works under "
            "(the peer label of its peers' per-peer metrics).",
            labelnames=[*labelnames, "engine_id"],
            multiprocess_mode="mostrecent",
        )
        for idx, values in per_engine_labelvalues.items():
            engine_id = engine_info_id(vllm_config, idx)
            if engine_id is not None:
                info.labels(*values, engine_id).set(1)

        def per_engine(metric):
            return create_metric_per_engine(metric, per_engine_labelvalues)

        self.seconds = per_engine(
            self._histogram_cls(
                name="vllm:pdext_kv_transfer_seconds",
                documentation="Seconds per KV transfer of a request (vllm-pd-ext connectors).",
                buckets=[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0],
                labelnames=labelnames,
            )
        )
        self.bytes = per_engine(
            self._histogram_cls(
                name="vllm:pdext_kv_transfer_bytes",
                documentation="Bytes per KV transfer of a request (vllm-pd-ext connectors).",
                buckets=[float(4**i * 1024) for i in range(1, 13)],
                labelnames=labelnames,
            )
        )
        self.failures = per_engine(
            self._counter_cls(
                name="vllm:pdext_kv_transfer_failures",
                documentation="KV transfers that failed or timed out (vllm-pd-ext connectors).",
                labelnames=labelnames,
            )
        )
        self.lease_expiries = per_engine(
            self._counter_cls(
                name="vllm:pdext_kv_lease_expiries",
                documentation="Prefill-side block leases that expired unrenewed (blocks freed).",
                labelnames=labelnames,
            )
        )
        self.unauthenticated = per_engine(
            self._counter_cls(
                name="vllm:pdext_kv_unauthenticated",
                documentation="Side-channel requests and data connections refused for want of "
                "a valid fleet-key tag (vllm-pd-ext connectors).",
                labelnames=labelnames,
            )
        )
        self.params_refused = per_engine(
            self._counter_cls(
                name="vllm:pdext_kv_params_refused",
                documentation="Decode requests whose kv_transfer_params were refused on arrival "
                "(malformed, unsigned, tampered with, expired) or whose WRITE KV was computed "
                "for another prompt: computed locally instead.",
                labelnames=labelnames,
            )
        )
        self.ungranted = per_engine(
            self._counter_cls(
                name="vllm:pdext_kv_ungranted",
                documentation="Peers' reads and writes of KV memory refused because they "
                "reached beyond the blocks leased or offered to them (vllm-pd-ext connectors).",
                labelnames=labelnames,
            )
        )
        self.fallbacks = per_engine(
            self._counter_cls(
                name="vllm:pdext_kv_transport_fallbacks",
                documentation="Connections to peers whose KV payloads the transport backend "
                "moves by a slower path than its own (cma: the socket, not cross-memory "
                "attach; the reason is logged).",
                labelnames=labelnames,
            )
        )
        self.blocks_held = per_engine(
            self._gauge_cls(
                name="vllm:pdext_kv_blocks_held",
                documentation="Prefill-side KV blocks held for decode instances.",
                labelnames=labelnames,
                multiprocess_mode="mostrecent",
            )
        )

    def _remove_peer(self, labelvalues: list[str], peer: str) -> None:
        """Drop an aged-out peer's series (a later return starts them at 0, a counter reset)."""
        for counter in self.peer_counters.values():
            with suppress(KeyError):  # older prometheus_client: a series never made
                counter.remove(*labelvalues, peer)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        d = transfer_stats_data
        for s in d.get("seconds", []):
            self.seconds[engine_idx].observe(s)
        for b in d.get("bytes", []):
            self.bytes[engine_idx].observe(b)
        if d.get("failures"):
            self.failures[engine_idx].inc(d["failures"])
        if d.get("lease_expiries"):
            self.lease_expiries[engine_idx].inc(d["lease_expiries"])
        if d.get("unauthenticated"):
            self.unauthenticated[engine_idx].inc(d["unauthenticated"])
        if d.get("params_refused"):
            self.params_refused[engine_idx].inc(d["params_refused"])
        if d.get("ungranted"):
            self.ungranted[engine_idx].inc(d["ungranted"])
        if d.get("fallbacks"):
            self.fallbacks[engine_idx].inc(d["fallbacks"])
        if d.get("blocks_held") is not None:
            self.blocks_held[engine_idx].set(d["blocks_held"])
        labelvalues = self.per_engine_labelvalues[engine_idx]
        for peer, row in d.get("peers", {}).items():
            label = self._peer_labels[engine_idx](peer)
            for field, counter in self.peer_counters.items():
                if row.get(field):
                    counter.labels(*labelvalues, label).inc(row[field])
