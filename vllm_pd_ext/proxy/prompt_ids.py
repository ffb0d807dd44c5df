"""Text mode: a text completion's prompt as the token ids the engine will see, so that the
engines' prefix indexes (``kv_events.py``) can be looked up for it.

vLLM tokenizes a completion's text prompt with the model's tokenizer, special tokens added;
the Rust ``tokenizers`` library does the same from the model's ``tokenizer.json``. The ids
only steer routing: a prompt tokenized differently finds fewer blocks, never wrong output.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from vllm_pd_ext.util.hf_encode import encode_ids

logger = logging.getLogger(__name__)

#: Prompts longer than this (characters) are not tokenized: routed on the estimate.
MAX_PROMPT_CHARS = 256_000
#: Threads that tokenize (the Rust tokenizer lets go of the GIL in ``encode_batch_fast``, so
#: the event loop runs on meanwhile); what waits for them is bounded by the proxy's admission.
THREADS = 2


class PromptTokenizer:
    """The served model's tokenizer, loaded once, run on threads of its own."""

    def __init__(self, directory: Path):
        from tokenizers import Tokenizer

        path = Path(directory) / "tokenizer.json"
        try:
            tokenizer: Any = Tokenizer.from_file(str(path))
        except Exception as exc:  # a missing or unreadable file: say which
            raise ValueError(f"tokenizer: cannot load {path}: {exc}") from exc
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self._tokenizer = tokenizer
        self._pool = ThreadPoolExecutor(THREADS, thread_name_prefix="pd-tokenize")
        logger.info("text prompts are tokenized for prefix lookups with %s", path)

    def encode_now(self, prompt: str) -> list[int] | None:
        """The prompt's ids with special tokens, as vLLM's completions route makes them;
        None for a prompt over ``MAX_PROMPT_CHARS``. Blocks for the encoding."""
        if len(prompt) > MAX_PROMPT_CHARS:
            return None
        return encode_ids(self._tokenizer, [prompt], add_special_tokens=True)[0]

    async def encode(self, prompt: str) -> list[int] | None:
        """:meth:`encode_now` on the tokenizer's threads."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.encode_now, prompt)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
