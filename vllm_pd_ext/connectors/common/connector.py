"""The KV connector shell our P/D connectors share (``PdExtMoRIIOConnector``, the hybrid-model
``PdExtMambaStateConnector``): every vLLM hook delegates to
:class:`~vllm_pd_ext.connectors.common.scheduler.TransferScheduler` (scheduler role, EngineCore)
or :class:`~vllm_pd_ext.connectors.common.worker.TransferWorker` (worker role), so a vLLM API
change touches this file only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from vllm_pd_ext.connectors.common.metadata import PdTransferMetadata
from vllm_pd_ext.connectors.common.shell import make_scheduler, make_worker
from vllm_pd_ext.connectors.common.stats import PdTransferPromMetrics, PdTransferStats

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class PdTransferConnector(KVConnectorBase_V1):
    """Prefill-to-decode KV transfer (READ and WRITE modes) over our transport layer."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        name = type(self).__name__
        self._scheduler = None
        self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = make_scheduler(name, vllm_config, kv_cache_config)
        else:
            self._worker = make_worker(name, vllm_config, kv_cache_config)

    # ---- scheduler side (EngineCore) ----
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._scheduler is not None:
            self._scheduler.kv_cache_manager = kv_cache_manager

    def on_new_request(self, request: Request) -> None:
        assert self._scheduler is not None
        self._scheduler.on_new_request(request)

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

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    # ---- worker side ----
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert self._worker is not None and isinstance(connector_metadata, PdTransferMetadata)
        self._worker.bind(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are asynchronous: requests wait in WAITING_FOR_REMOTE_KVS

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        assert self._worker is not None
        self._worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        return self._worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        sending, recving = self._worker.get_finished(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(recving or ()),
            failed_recving=self._worker.take_failed_loads(),
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.get_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> PdTransferStats | None:
        return self._worker.stats.take() if self._worker is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # ---- metrics (EngineCore / API server) ----
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PdTransferStats:
        return PdTransferStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(
        cls, vllm_config, metric_types, labelnames, per_engine_labelvalues
    ) -> PdTransferPromMetrics:
        return PdTransferPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
