"""PdExtMambaStateConnector: placeholder until the hybrid-model issue (#7) lands.

It declares ``SupportsHMA`` already, so vLLM's hybrid-allocator check accepts the name, and
fails at construction with a message naming the tracking issue.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA

from vllm_pd_ext.connectors.common.placeholder import not_implemented


class PdExtMambaStateConnector(KVConnectorBase_V1, SupportsHMA):
    """Hybrid attention + SSM P/D connector (not implemented yet)."""

    def __new__(cls, *args, **kwargs):
        raise not_implemented(cls.__name__, issue=7)
