"""Tiered-cache statistics through vLLM's connector stats and Prometheus hooks.

Both sides record into a :class:`FlexKVStats` (scheduler: lookups, hits and evictions per
tier; worker: bytes and seconds per tier, corrupt blocks, failed loads, dropped writes).
vLLM aggregates the plain ``data`` dicts, logs :meth:`FlexKVStats.reduce` and feeds
:class:`FlexKVPromMetrics`, which exports on the engine's ``/metrics``
(``tier`` is ``cpu``, ``ssd``, ``shared`` or ``remote``):

* ``vllm:pdext_flexkv_lookup_blocks_total``: blocks looked up beyond the local prefix cache;
* ``vllm:pdext_flexkv_hit_blocks_total{tier}``: blocks loaded from each tier;
* ``vllm:pdext_flexkv_load_bytes_total{tier}``, ``..._load_seconds_total{tier}``;
* ``vllm:pdext_flexkv_save_bytes_total{tier}``, ``..._save_seconds_total{tier}``;
* ``vllm:pdext_flexkv_evicted_blocks_total{tier}``;
* ``vllm:pdext_flexkv_corrupt_blocks_total``, ``..._failed_blocks_total`` (loads that failed,
  corrupt ones included), ``..._dropped_writes_total`` (I/O queue full),
  ``..._remote_down_total`` (the remote tier's store stopped answering).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from vllm_pd_ext.connectors.flexkv.metadata import TIERS

PER_TIER = (
    "hit_blocks",
    "load_bytes",
    "load_seconds",
    "save_bytes",
    "save_seconds",
    "evicted_blocks",
)
PLAIN = ("lookup_blocks", "corrupt_blocks", "failed_blocks", "dropped_writes", "remote_down")


class FlexKVStats(KVConnectorStats):
    """One interval's counters: ``data`` maps ``"<counter>"`` or ``"<counter>.<tier>"`` to a
    number; aggregation adds them up."""

    data: dict[str, Any]  # KVConnectorStats' field

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for k, v in sorted(self.data.items()):
            if "bytes" in k:
                out[k.replace("bytes", "MB")] = round(v / 1e6, 3)
            elif "seconds" in k:
                out[k.replace("seconds", "ms")] = round(v * 1e3, 3)
            else:
                out[k] = v
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class FlexKVRecorder:
    """Thread-safe accumulator (worker I/O threads and the engine thread write into it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, float] = defaultdict(float)

    def add(self, counter: str, value: float = 1, tier: str | None = None) -> None:
        key = f"{counter}.{tier}" if tier else counter
        with self._lock:
            self._data[key] += value

    def take(self) -> FlexKVStats | None:
        """The interval's stats (None when nothing happened), then start a new interval."""
        with self._lock:
            data, self._data = dict(self._data), defaultdict(float)
        data = {
            k: (int(v) if not k.startswith(("load_seconds", "save_seconds")) else v)
            for k, v in data.items()
            if v
        }
        return FlexKVStats(data=data) if data else None


class FlexKVPromMetrics(KVConnectorPromMetrics):
    """The tiered cache's Prometheus counters (registered through ``build_prom_metrics``)."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        docs = {
            "hit_blocks": "KV blocks loaded from a tier of the tiered cache.",
            "load_bytes": "Bytes loaded from a tier into the KV cache.",
            "load_seconds": "Seconds spent loading from a tier (summed over loads).",
            "save_bytes": "Bytes saved into a tier.",
            "save_seconds": "Seconds spent saving into a tier (summed over saves).",
            "evicted_blocks": "KV blocks evicted from a tier.",
            "lookup_blocks": "KV blocks looked up in the tiered cache beyond the local hit.",
            "corrupt_blocks": "Stored KV blocks that failed their checksum, MAC or header check.",
            "failed_blocks": "KV blocks whose load failed (recomputed or failed per policy).",
            "dropped_writes": "Block file writes dropped because the I/O queue was full.",
            "remote_down": "Times the remote tier's store stopped answering (its blocks are "
            "misses until a probe finds it again).",
        }
        self._per_tier: dict[str, dict[int, dict[str, Any]]] = {}
        for name in PER_TIER:
            metric = self._counter_cls(
                name=f"vllm:pdext_flexkv_{name}",
                documentation=docs[name],
                labelnames=[*labelnames, "tier"],
            )
            self._per_tier[name] = {
                idx: {t: metric.labels(*values, t) for t in TIERS}
                for idx, values in per_engine_labelvalues.items()
            }
        self._plain: dict[str, dict[int, Any]] = {}
        for name in PLAIN:
            metric = self._counter_cls(
                name=f"vllm:pdext_flexkv_{name}", documentation=docs[name], labelnames=labelnames
            )
            self._plain[name] = {
                idx: metric.labels(*values) for idx, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            if not value:
                continue
            name, _, tier = key.partition(".")
            if tier and name in self._per_tier and tier in TIERS:
                self._per_tier[name][engine_idx][tier].inc(value)
            elif not tier and name in self._plain:
                self._plain[name][engine_idx].inc(value)
