"""Moving KV bytes between processes: one small interface and backends chosen by name.

```python
from vllm_pd_ext.transport import get_backend

t = get_backend("mooncake", host="127.0.0.1", protocol="tcp")
t.register_tensor("layer0", kv_layer0)
side_channel.send(t.descriptor().to_bytes())
peer = t.connect(side_channel.recv())
h = t.write(peer, "layer0", "layer0", [(0, 0, 4096), (8192, 4096, 4096)])
h.wait(timeout=5.0)
t.notify(peer, b'{"done": "req-1"}')
```

Backends by name: ``mooncake`` (Mooncake's transfer engine, TCP or RDMA), ``mori`` (AMD
MoRI-IO, ROCm) and ``tcp`` (our own data path over plain TCP sockets, host memory; see
:mod:`vllm_pd_ext.transport.tcp`). See :mod:`vllm_pd_ext.transport.base` for the contract.
"""

from __future__ import annotations

from vllm_pd_ext.transport.base import (
    Notification,
    Region,
    TransferHandle,
    TransferOp,
    TransferState,
    Transport,
    TransportDescriptor,
)
from vllm_pd_ext.transport.errors import (
    PeerError,
    PeerMismatch,
    PeerUnreachable,
    RegionBoundsError,
    RegistrationError,
    TransferError,
    TransferTimeout,
    TransportClosed,
    TransportError,
    UnknownPeer,
    UnknownRegion,
)
from vllm_pd_ext.transport.registry import (
    backend_class,
    backend_names,
    get_backend,
    register_backend,
)
from vllm_pd_ext.transport.stats import StatsSnapshot, TransferStats

__all__ = [
    "Notification",
    "PeerError",
    "PeerMismatch",
    "PeerUnreachable",
    "Region",
    "RegionBoundsError",
    "RegistrationError",
    "StatsSnapshot",
    "TransferError",
    "TransferHandle",
    "TransferOp",
    "TransferState",
    "TransferStats",
    "TransferTimeout",
    "Transport",
    "TransportClosed",
    "TransportDescriptor",
    "TransportError",
    "UnknownPeer",
    "UnknownRegion",
    "backend_class",
    "backend_names",
    "get_backend",
    "register_backend",
]
