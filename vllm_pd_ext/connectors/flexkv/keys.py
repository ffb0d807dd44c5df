"""Block keys of the tiered cache: chained hashes of full token blocks, like vLLM's.

vLLM hashes block ``i`` of a request as ``H(parent hash, block tokens, extra keys)`` with the
request's ``cache_salt`` (and LoRA) folded into the first block; its root ``NONE_HASH`` is
random per process unless ``PYTHONHASHSEED`` is set, so its hashes cannot name files that
another process or a restarted engine reads. We chain the same way from a root that is
stable: a hash of the cache's namespace (model facts, block size, TP size, the configured
``namespace``), the ``cache_salt`` and the LoRA name. Two requests share block ``i`` only when
the whole prefix up to it, the salt, the model and the block size are the same.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from vllm.v1.request import Request

#: Bump when the key derivation or the block file format changes: old files stop matching.
FORMAT = 3  # 2: layout fingerprint of connectors/common/layout.py; 3: xxh3-64 checksums


def cache_namespace(model: Mapping[str, Any], block_size: int, extra: str = "") -> str:
    """A short id of everything two engines must agree on to share blocks."""
    doc = {"format": FORMAT, "model": dict(model), "block_size": block_size, "ns": extra}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def root_hash(namespace: str, cache_salt: str | None, lora_name: str | None) -> bytes:
    """The chain's root for one request: tenants with different salts never share a block."""
    h = hashlib.sha256()
    for part in (namespace, cache_salt or "", lora_name or ""):
        b = part.encode()
        h.update(len(b).to_bytes(4, "little") + b)
    return h.digest()


def chain_keys(root: bytes, token_ids: Sequence[int], block_size: int, n_blocks: int) -> list[str]:
    """Hex keys of the first ``n_blocks`` full blocks of ``token_ids``."""
    arr = np.asarray(token_ids[: n_blocks * block_size], dtype=np.int64)
    keys, parent = [], root
    for i in range(min(n_blocks, len(arr) // block_size)):
        parent = hashlib.sha256(
            parent + arr[i * block_size : (i + 1) * block_size].tobytes()
        ).digest()[:16]
        keys.append(parent.hex())
    return keys


def group_key(key: str, group: int) -> str:
    """The key of KV cache group ``group``'s block at the position ``key`` names: ``key``
    itself for group 0 (a model with one group keeps its keys), a hash of it and the group
    for the others (a hybrid model's attention blocks and SSM state pages at one prefix)."""
    if group == 0:
        return key
    return hashlib.sha256(bytes.fromhex(key) + group.to_bytes(4, "little")).digest()[:16].hex()


def request_keys(request: Request, namespace: str, block_size: int) -> list[str]:
    """Keys of the request's full prompt blocks; [] when it cannot be cached safely.

    Multimodal inputs and prompt embeddings change the KV without changing the token ids,
    so such requests are neither loaded nor saved.
    """
    if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None:
        return []
    prompt = request.prompt_token_ids or []
    lora = getattr(request, "lora_request", None)
    root = root_hash(namespace, request.cache_salt, lora.lora_name if lora else None)
    return chain_keys(root, prompt, block_size, len(prompt) // block_size)
