"""PdExtMoRIIOConnector: prefill-to-decode KV transfer over our transport layer.

Backend ``mori`` (AMD MoRI-IO, ROCm) or ``mooncake`` (TCP / RDMA) is chosen in
``kv_connector_extra_config``; modes READ (decode pulls after prefill) and WRITE (prefill pushes
each layer into decode's blocks). The class is the shared shell in
:mod:`vllm_pd_ext.connectors.common.connector`; for hybrid attention + SSM models use
``PdExtMambaStateConnector``.
"""

from __future__ import annotations

from vllm_pd_ext.connectors.common.connector import PdTransferConnector


class PdExtMoRIIOConnector(PdTransferConnector):
    """Prefill-to-decode KV transfer (READ and WRITE modes), MoRI-IO or Mooncake transport."""
