"""The vLLM-facing half every connector of ours shares: ``KVConnectorBase_V1`` hooks that only
forward to a scheduler-side object (EngineCore) or a worker-side object (worker process).

A connector sets ``_scheduler`` or ``_worker`` in ``__init__`` (the other stays None), names its
metadata, stats and Prometheus classes, and overrides only the hooks where it differs, so a vLLM
API change touches this file and the connector shells, never the scheduler or worker logic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

if TYPE_CHECKING:
    import torch
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


class DelegatingConnector(KVConnectorBase_V1):
    """Forwards the hooks every connector of ours implements the same way."""

    #: The ``KVConnectorMetadata`` subclass the scheduler side builds.
    _metadata_type: ClassVar[type[KVConnectorMetadata]]
    #: ``KVConnectorStats`` and ``KVConnectorPromMetrics`` subclasses.
    _stats_type: ClassVar[type]
    _prom_type: ClassVar[type]

    _scheduler: Any = None
    _worker: Any = None

    # ---- scheduler side (EngineCore) ----
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._scheduler is not None:
            self._scheduler.kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    # ---- worker side ----
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert self._worker is not None and isinstance(connector_metadata, self._metadata_type)
        self._worker.bind(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads end in start_load_kv or run while requests wait for remote KVs

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.wait_for_save()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # ---- metrics (EngineCore / API server) ----
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        return cls._stats_type(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return cls._prom_type(vllm_config, metric_types, labelnames, per_engine_labelvalues)
