"""What the scheduler side tells the worker side each step (``KVConnectorMetadata``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

CPU, SSD, SHARED, REMOTE = "cpu", "ssd", "shared", "remote"
TIERS = (CPU, SSD, SHARED, REMOTE)


@dataclass(frozen=True)
class LoadItem:
    """Copy block ``key`` from ``tier`` (CPU pool row ``slot``, or its file) into device
    block ``block_id`` of KV cache group ``group``; when ``promote_slot`` >= 0 also keep it
    in that CPU pool row."""

    block_id: int
    key: str
    tier: str
    slot: int = -1
    promote_slot: int = -1
    group: int = 0


@dataclass(frozen=True)
class LoadJob:
    """One request's load: synchronous (``sync``: done in ``start_load_kv``, before the
    forward pass of the same step) or asynchronous (reported in ``finished_recving``)."""

    req_id: str
    items: tuple[LoadItem, ...]
    sync: bool = False


@dataclass(frozen=True)
class SaveItem:
    """Save device block ``block_id`` (of KV cache group ``group``) of request ``req_id`` as
    ``key``: into CPU pool row ``slot`` (>= 0), as a file in the SSD and/or shared tier,
    and/or in the remote tier. ``state``: a state page (Mamba), which vLLM may hand to
    another request two steps later: the worker copies it before the next step runs."""

    block_id: int
    key: str
    req_id: str = ""
    slot: int = -1
    ssd: bool = False
    shared: bool = False
    remote: bool = False
    group: int = 0
    state: bool = False


@dataclass
class FlexKVMetadata(KVConnectorMetadata):
    """One step's instructions: loads to start, saves to take after the forward pass, requests
    preempted in this step (their blocks are about to be reused: saves still reading them must
    end first), SSD block files to delete (evicted), and whether to wipe the SSD tier (reset)."""

    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveItem] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
    ssd_deletes: list[str] = field(default_factory=list)
    clear_ssd: bool = False
