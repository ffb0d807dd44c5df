"""The KV connector shell our P/D connectors share (``PdExtMoRIIOConnector``, the hybrid-model
``PdExtMambaStateConnector``): every vLLM hook delegates to
:class:`~vllm_pd_ext.connectors.common.scheduler.TransferScheduler` (scheduler role, EngineCore)
or :class:`~vllm_pd_ext.connectors.common.worker.TransferWorker` (worker role); the hooks every
connector of ours forwards alike are in :mod:`~vllm_pd_ext.connectors.common.delegating`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from vllm_pd_ext.connectors.common.delegating import DelegatingConnector
from vllm_pd_ext.connectors.common.metadata import PdTransferMetadata
from vllm_pd_ext.connectors.common.shell import make_scheduler, make_worker
from vllm_pd_ext.connectors.common.stats import PdTransferPromMetrics, PdTransferStats

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class PdTransferConnector(DelegatingConnector):
    """Prefill-to-decode KV transfer (READ and WRITE modes) over our transport layer."""

    _cache_hit_source = CacheHitSource.P2P
    _metadata_type = PdTransferMetadata
    _stats_type = PdTransferStats
    _prom_type = PdTransferPromMetrics

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
    def on_new_request(self, request: Request) -> None:
        assert self._scheduler is not None
        self._scheduler.on_new_request(request)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    # ---- worker side ----
    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        assert self._worker is not None
        self._worker.save_kv_layer(layer_name)

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
        if self._worker is not None:
            return self._worker.stats.take()
        return self._scheduler.stats.take() if self._scheduler is not None else None
