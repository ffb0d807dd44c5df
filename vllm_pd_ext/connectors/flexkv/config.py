"""``kv_connector_extra_config`` of ``PdExtFlexKVConnector``, validated once at construction."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from vllm_pd_ext.connectors.common.config import parse_extra_config

GiB = 1 << 30


class RemoteTierConfig(BaseModel):
    """Where the remote tier's Mooncake Store is (``connectors/flexkv/remote.py``)."""

    model_config = ConfigDict(extra="forbid")

    master: str = Field(
        ..., min_length=3, description="The store's master (`mooncake_master`), host:rpc_port."
    )
    metadata_server: str = Field(
        "P2PHANDSHAKE",
        min_length=3,
        description="How the store's clients find each other: P2PHANDSHAKE (directly, no "
        "server), or a metadata server's URL (http://host:port/metadata).",
    )
    local_hostname: str = Field(
        "127.0.0.1",
        min_length=1,
        description="Address this instance's store client listens on for other clients "
        "(a private network's, for a fleet on several hosts).",
    )
    segment_gb: float = Field(
        1.0, gt=0, description="Memory this instance adds to the store, in GiB."
    )
    buffer_mb: int = Field(64, ge=1, le=4096, description="The client's transfer buffer, in MiB.")
    protocol: Literal["tcp", "rdma"] = Field("tcp", description="The transfer engine's protocol.")


class FlexKVConfig(BaseModel):
    """Tiers, capacities and I/O limits of the tiered KV cache.

    Every key is optional; an unknown key or a bad value fails the engine's start with a
    message naming it. Without ``ssd_dir``, ``shared_dir`` and ``remote`` only the CPU tier is
    used.
    """

    model_config = ConfigDict(extra="forbid")

    cpu_capacity_gb: float = Field(
        1.0, ge=0, description="CPU memory tier size in GiB (0 disables the tier)."
    )
    cpu_capacity_blocks: int | None = Field(
        None, ge=0, description="CPU tier size in KV blocks; overrides cpu_capacity_gb."
    )
    ssd_dir: str | None = Field(
        None, description="Directory of the local SSD tier (created if missing); None: no SSD."
    )
    ssd_capacity_gb: float = Field(16.0, gt=0, description="SSD tier size in GiB.")
    ssd_capacity_blocks: int | None = Field(
        None, ge=1, description="SSD tier size in KV blocks; overrides ssd_capacity_gb."
    )
    shared_dir: str | None = Field(
        None,
        description="Directory several instances share (NFS, a common disk): blocks written "
        "there are loadable by every instance with the same model and block size.",
    )
    shared_capacity_gb: float = Field(
        64.0,
        gt=0,
        description="Size the shared directory's block files (this model and block size) are "
        "kept within: every instance writing it deletes the oldest files when it is over.",
    )
    remote: RemoteTierConfig | None = Field(
        None,
        description="A Mooncake Store every instance of the fleet reaches (the remote tier, "
        "after CPU, SSD and shared): blocks saved there load on any instance, any host.",
    )
    io_threads: int = Field(4, ge=1, le=64, description="Threads of the file I/O pool.")
    load_threads: int = Field(2, ge=1, le=32, description="Requests loaded at once.")
    max_pending_writes: int = Field(
        1024,
        ge=1,
        description="Block file writes queued at most; beyond it new writes are dropped "
        "(counted), so saves never stall the engine.",
    )
    fsync: bool = Field(
        False, description="fsync each block file before it becomes visible (power-loss safety)."
    )
    sync_load: Literal["cpu", "all", "never"] = Field(
        "cpu",
        description="Which hits load synchronously, in the step that computes the rest of "
        "the prompt (no extra engine step): 'cpu' (hits wholly in the CPU tier; file reads "
        "stay asynchronous), 'all', or 'never' (every load waits in WAITING_FOR_REMOTE_KVS).",
    )
    min_match_blocks: int = Field(
        1, ge=1, description="Load only when at least this many blocks hit (else recompute)."
    )
    eviction_window: int = Field(
        8,
        ge=1,
        le=1024,
        description="LRU-with-frequency eviction: the least-hit entry among this many "
        "least-recently-used ones is evicted (1 = plain LRU).",
    )
    namespace: str = Field(
        "",
        max_length=128,
        description="Extra isolation key (e.g. a weights version): caches with different "
        "namespaces never share blocks.",
    )
    reset_clears_disk: bool = Field(
        False,
        description="reset_cache (POST /reset_prefix_cache?reset_external=true) also deletes "
        "this instance's SSD tier; by default it clears the CPU tier only.",
    )

    @model_validator(mode="after")
    def _some_tier(self) -> FlexKVConfig:
        if self.cpu_blocks_hint() == 0 and not (self.ssd_dir or self.shared_dir or self.remote):
            raise ValueError(
                "no tier left: the CPU tier is 0 and none of ssd_dir, shared_dir, remote"
            )
        return self

    def cpu_blocks_hint(self) -> int | None:
        """0 when the CPU tier is disabled, else None (size depends on the block bytes)."""
        if self.cpu_capacity_blocks is not None:
            return self.cpu_capacity_blocks or 0
        return 0 if self.cpu_capacity_gb == 0 else None

    def cpu_slots(self, block_bytes: int) -> int:
        """CPU tier size in blocks of ``block_bytes`` each."""
        if self.cpu_capacity_blocks is not None:
            return self.cpu_capacity_blocks
        return int(self.cpu_capacity_gb * GiB) // max(block_bytes, 1)

    def ssd_blocks(self, block_bytes: int) -> int:
        """SSD tier size in blocks of ``block_bytes`` each."""
        if self.ssd_capacity_blocks is not None:
            return self.ssd_capacity_blocks
        return max(1, int(self.ssd_capacity_gb * GiB) // max(block_bytes, 1))


def parse_flexkv_config(connector: str, extra: Mapping[str, Any] | None) -> FlexKVConfig:
    """Validate ``extra``; ``ValueError`` naming the connector and the bad key otherwise."""
    return parse_extra_config(FlexKVConfig, connector, extra)
