"""Multi-turn tokenization cache: text between added tokens is tokenized once, then reused.

The Rust tokenizer cuts added tokens (``<|im_start|>``, ``<|im_end|>``, ...) out of the text
before normalizing and pre-tokenizing, so each stretch of text between two added tokens is
tokenized on its own. A chat prompt is therefore the concatenation of those segments' ids, and a
conversation's earlier turns are segments already seen. This cache keys ids by segment text
(LRU, bounded by the bytes its entries hold: the text and its ids packed 4 bytes each, not as
Python ints, which cost ~58 bytes per character of text) and only tokenizes segments it has not
seen: turn *k+1* costs the new messages, not the whole history, and the ids equal a full
``encode`` exactly.

It is enabled only for tokenizers where that equivalence holds (added tokens without
``lstrip``/``rstrip``/``single_word``, and either no normalizer or only added tokens matched on
the raw text), see :func:`supports_segment_cache`.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from vllm_pd_ext.util.hf_encode import encode_ids

logger = logging.getLogger(__name__)

#: Segments shorter than this are tokenized directly (a dict entry costs more than they do).
MIN_CACHED_CHARS = 64
#: What one entry costs beyond its text and its ids: the ids' array object and the dict and
#: LRU links.
_ENTRY_OVERHEAD = sys.getsizeof(array("I")) + 100


def supports_segment_cache(backend: Any) -> bool:
    """Whether segment-wise encoding equals whole-text encoding for this Rust tokenizer."""
    added = backend.get_added_tokens_decoder()
    if not added:
        return False
    has_normalizer = backend.normalizer is not None
    for tok in added.values():
        if tok.lstrip or tok.rstrip or tok.single_word:
            return False
        if tok.normalized and has_normalizer:
            # matched on normalized text, which can differ from the raw text we split
            return False
    # The normalizer (e.g. NFC) runs per stretch between raw added tokens anyway.
    return True


def added_token_splitter(backend: Any) -> re.Pattern[str]:
    """A regex whose ``split`` cuts the added tokens out of a text (capturing them)."""
    contents = sorted(
        (tok.content for tok in backend.get_added_tokens_decoder().values()), key=len, reverse=True
    )
    return re.compile("(" + "|".join(re.escape(c) for c in contents) + ")")


class SegmentCache:
    """Thread-safe LRU of segment text -> token ids, bounded by the bytes it holds.

    ``encode_pieces`` encodes texts without added tokens (default: the Rust tokenizer's batch
    encode; the render server passes the tiktoken fast path when it is exact, see
    :mod:`.fast_bpe`).
    """

    def __init__(
        self,
        backend: Any,
        max_bytes: int = 256 << 20,
        encode_pieces: Callable[[list[str]], list[list[int]]] | None = None,
    ) -> None:
        self.backend = backend
        self.max_bytes = max_bytes
        added = backend.get_added_tokens_decoder()
        self.added_ids = {tok.content: tid for tid, tok in added.items()}
        self.splitter = added_token_splitter(backend)
        self.encode_pieces = encode_pieces or self._hf_encode_pieces
        self._entries: OrderedDict[str, array[int]] = OrderedDict()
        #: What the entries hold: text, packed ids and each entry's overhead.
        self.bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` without special-token post-processing (``add_special_tokens=False``)."""
        pieces = self.splitter.split(text)
        out: list[int] = []
        misses: list[tuple[int, str]] = []
        parts: list[list[int] | array[int] | None] = []
        with self._lock:
            for i, piece in enumerate(pieces):
                if not piece:
                    parts.append([])
                elif i % 2 == 1:  # odd pieces are the captured added tokens
                    parts.append([self.added_ids[piece]])
                elif len(piece) >= MIN_CACHED_CHARS and piece in self._entries:
                    self._entries.move_to_end(piece)
                    parts.append(self._entries[piece])
                    self.hits += 1
                else:
                    parts.append(None)
                    misses.append((i, piece))
        if misses:
            encoded = self.encode_pieces([p for _, p in misses])
            with self._lock:
                for (i, piece), ids in zip(misses, encoded, strict=True):
                    parts[i] = ids
                    if len(piece) >= MIN_CACHED_CHARS:
                        self.misses += 1
                        self._put(piece, ids)
        for part in parts:
            out.extend(part)  # type: ignore[arg-type]
        return out

    def _hf_encode_pieces(self, pieces: list[str]) -> list[list[int]]:
        return encode_ids(self.backend, pieces, add_special_tokens=False)

    def _put(self, piece: str, ids: list[int]) -> None:
        if piece in self._entries:
            return
        packed = array("I", ids)
        self._entries[piece] = packed
        self.bytes += _cost(piece, packed)
        while self.bytes > self.max_bytes and self._entries:
            old, old_ids = self._entries.popitem(last=False)
            self.bytes -= _cost(old, old_ids)


def _cost(piece: str, ids: array[int]) -> int:
    return sys.getsizeof(piece) + ids.itemsize * len(ids) + _ENTRY_OVERHEAD
