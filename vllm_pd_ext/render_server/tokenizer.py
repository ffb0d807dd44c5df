"""Loading the tokenizer once per process, and the facts about it render/derender need.

Uses ``transformers`` (fast tokenizers only) for chat templates and the Rust ``tokenizers``
backend directly for encoding, which skips Python-side overhead on long prompts; for byte-level
BPE tokenizers a tiktoken encoder proven identical at startup does the BPE (:mod:`.fast_bpe`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from vllm_pd_ext.util.hf_encode import encode_ids

logger = logging.getLogger(__name__)

#: Post-processors that only put fixed ids around a single sequence (checked at startup too).
_FIXED_AFFIX_PROCESSORS = frozenset(
    {"ByteLevel", "TemplateProcessing", "RobertaProcessing", "BertProcessing", "Sequence"}
)


@dataclass
class TokenizerInfo:
    """A loaded fast tokenizer plus the derived values render and derender use."""

    hf: Any  # transformers.PreTrainedTokenizerFast
    chat_template: str | None
    #: Try the tiktoken fast path (:mod:`.fast_bpe`); it still needs its startup self-check.
    fast_bpe_enabled: bool = True

    @cached_property
    def backend(self) -> Any:
        """The Rust ``tokenizers.Tokenizer``."""
        return self.hf.backend_tokenizer

    @cached_property
    def vocab_size(self) -> int:
        """``len(tokenizer)``: base vocabulary plus added tokens."""
        return len(self.hf)

    @cached_property
    def special_ids(self) -> frozenset[int]:
        return frozenset(self.hf.all_special_ids)

    @cached_property
    def max_chars_per_token(self) -> int:
        return max(len(tok) for tok in self.hf.get_vocab())

    @cached_property
    def fast_bpe(self) -> Any:
        """The exact tiktoken encoder of text between added tokens, or None (HF encodes)."""
        from vllm_pd_ext.render_server.fast_bpe import build_fast_bpe
        from vllm_pd_ext.render_server.segment_cache import (
            added_token_splitter,
            supports_segment_cache,
        )

        if not self.fast_bpe_enabled:
            logger.info("fast BPE path off (disabled by the settings)")
            return None
        if not supports_segment_cache(self.backend):
            # the fast path encodes the text between added tokens, cut out as the cache does
            logger.info("fast BPE path off (HF tokenizer used): added tokens not cut out raw")
            return None
        return build_fast_bpe(self.backend, exclude=added_token_splitter(self.backend))

    @cached_property
    def segment_cache(self) -> Any:
        """The multi-turn :class:`SegmentCache`, or None when this tokenizer cannot use it."""
        from vllm_pd_ext.render_server.segment_cache import SegmentCache, supports_segment_cache

        if not supports_segment_cache(self.backend):
            logger.info("segment cache off: tokenizer splits are not independent")
            return None
        fast = self.fast_bpe
        return SegmentCache(self.backend, encode_pieces=fast.encode_batch if fast else None)

    @cached_property
    def special_affixes(self) -> tuple[list[int], list[int]] | None:
        """The ids the post-processor puts before and after one sequence
        (``add_special_tokens=True``), or None when it does more than add fixed ids."""
        post = self.backend.post_processor
        if post is None:
            return [], []
        if type(post).__name__ not in _FIXED_AFFIX_PROCESSORS:
            return None
        found: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
        for text in ("a", "Hello world", " x\n1 ü"):
            plain = self.backend.encode(text, add_special_tokens=False).ids
            full = self.backend.encode(text, add_special_tokens=True).ids
            n = len(plain)
            at = next((k for k in range(len(full) - n + 1) if full[k : k + n] == plain), None)
            if at is None:
                return None
            found.add((tuple(full[:at]), tuple(full[at + n :])))
        if len(found) != 1:
            return None
        pre, post_ids = found.pop()
        return list(pre), list(post_ids)

    def warm_up(self) -> None:
        """Compute every derived value now (startup), so no request pays for it."""
        _ = (self.backend, self.vocab_size, self.special_ids, self.max_chars_per_token)
        _ = (self.segment_cache, self.special_affixes)
        self.encode("warm up <|im_start|> ü", add_special_tokens=False)

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """Token ids of ``text`` (no truncation), exactly the HF tokenizer's; reuses cached
        segments and the fast path when it can."""
        cache = self.segment_cache
        if cache is not None:
            if not add_special_tokens:
                return cache.encode(text)
            affixes = self.special_affixes
            if affixes is not None:
                pre, post = affixes
                ids = cache.encode(text)
                return [*pre, *ids, *post] if pre or post else ids
        return self._hf_encode_batch([text], add_special_tokens=add_special_tokens)[0]

    def encode_batch(self, texts: list[str], *, add_special_tokens: bool) -> list[list[int]]:
        """Ids of each text, as :meth:`encode`."""
        if self.segment_cache is not None:
            return [self.encode(t, add_special_tokens=add_special_tokens) for t in texts]
        return self._hf_encode_batch(texts, add_special_tokens=add_special_tokens)

    def _hf_encode_batch(self, texts: list[str], *, add_special_tokens: bool) -> list[list[int]]:
        """Ids of each text from the HF tokenizer's Rust backend, no segment cache."""
        return encode_ids(self.backend, texts, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def ids_to_tokens(self, ids: list[int], *, skip_special_tokens: bool) -> list[str]:
        """``convert_ids_to_tokens`` with None replaced by ""; special tokens dropped if asked."""
        out = []
        to_token = self.backend.id_to_token
        special = self.special_ids
        for i in ids:
            if skip_special_tokens and i in special:
                continue
            out.append(to_token(i) or "")
        return out

    def tokens_to_string(self, tokens: list[str]) -> str:
        """``convert_tokens_to_string`` of a fast tokenizer (the backend decoder)."""
        decoder = self.backend.decoder
        if decoder is None:
            return " ".join(tokens)
        return decoder.decode(tokens)

    def token_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)


def load_tokenizer(
    model_dir: str | os.PathLike[str], chat_template: str | None, *, fast_bpe: bool = True
) -> TokenizerInfo:
    """Load the fast tokenizer in ``model_dir`` offline; ``chat_template`` overrides the model's;
    ``fast_bpe`` False keeps the tiktoken fast path off.

    Raises ``ValueError`` when the directory holds no fast tokenizer.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    if not getattr(hf, "is_fast", False):
        raise ValueError(f"{model_dir}: only fast (tokenizer.json) tokenizers are supported")
    template = chat_template
    if template is None:
        template = getattr(hf, "chat_template", None)
        if isinstance(template, dict):
            template = template.get("default")
    if template is None:
        jinja = Path(model_dir) / "chat_template.jinja"
        if jinja.is_file():
            template = jinja.read_text()
    logger.info("loaded tokenizer from %s (%d tokens)", model_dir, len(hf))
    return TokenizerInfo(hf=hf, chat_template=template, fast_bpe_enabled=fast_bpe)
