"""The ``<think>...</think>`` reasoning family (vLLM's ``deepseek_r1``; ``qwen3`` alias)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from vllm_pd_ext.render_server.errors import RenderError
from vllm_pd_ext.render_server.parsers.state import ParserState

START = "<think>"
END = "</think>"


class ThinkState(ParserState):
    """The reasoning keys of :class:`ChatParser`'s streaming state with a reasoning parser."""

    #: the reasoning is over (by the prompt, or ``</think>`` came): the rest is content
    reasoning_ended: bool
    #: ``<think>`` came (set from the first chunk on)
    seen_start: bool = False
    #: text markers only: a partial marker held back at the chunk's end
    pending: str = Field(default="", max_length=max(len(START), len(END)) - 1)


class ThinkReasoningParser:
    """Splits reasoning from content at ``</think>``; a leading ``<think>`` is dropped.

    Like vLLM's DeepSeek-R1 parser, output without any marker counts as reasoning until
    ``</think>`` arrives (models whose template opens ``<think>`` in the prompt).

    ``text_markers``: when the tokenizer has no ``<think>`` / ``</think>`` tokens, find the
    markers in the text instead (vLLM's ``qwen3`` parser does so); otherwise such a tokenizer
    raises :class:`RenderError` (vLLM's ``deepseek_r1`` refuses it).
    """

    start = START
    end = END

    def __init__(self, tok: Any, *, text_markers: bool = False) -> None:
        self.start_id = tok.token_id(self.start)
        self.end_id = tok.token_id(self.end)
        #: the markers are plain text to this tokenizer: found in the text, not the ids
        self.by_text = self.start_id is None or self.end_id is None
        if self.by_text and not text_markers:
            raise RenderError(
                "ThinkReasoningParser reasoning parser could not locate think start/end "
                "tokens in the tokenizer!",
                status=500,
                err_type="InternalServerError",
            )

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """``(reasoning, content)`` of a complete output."""
        before, sep, after = text.partition(self.start)
        text = after if sep else before
        if self.end not in text:
            return text, None
        reasoning, _, content = text.partition(self.end)
        return reasoning, content or None

    def prompt_ended_reasoning(self, prompt_ids: list[int]) -> bool:
        """True when the prompt's last think marker closes reasoning (scans from the end).

        With text markers there are no marker ids to find: False, as vLLM's ``qwen3`` answers.
        """
        if self.by_text:
            return False
        rev = prompt_ids[::-1]  # list.index runs in C: ~20x faster than a Python loop
        n = len(rev)
        start = rev.index(self.start_id) if self.start_id in rev else n
        end = rev.index(self.end_id) if self.end_id in rev else n
        return end < start

    def split_delta(
        self, text: str, ids: list[int], seen_start: bool
    ) -> tuple[str | None, str | None, bool, bool]:
        """``(reasoning, content, ended, seen_start)`` for one chunk while reasoning is open.

        Follows vLLM's DeepSeek-R1 streaming rules token for token, including keeping a
        ``<think>`` that arrives together with other tokens in the reasoning text.
        """
        has_start = self.start_id in ids
        has_end = self.end_id in ids
        if len(ids) == 1 and ids[0] in (self.start_id, self.end_id):
            return None, None, has_end, seen_start or has_start
        if has_end:
            idx = text.find(self.end)
            if seen_start or not has_start:
                reasoning, content = text[:idx], text[idx + len(self.end) :]
            else:
                s_idx = text.find(self.start)
                reasoning = text[s_idx + len(self.start) : idx]
                content = text[idx + len(self.end) :]
            return reasoning, content or None, True, True
        return text, None, False, seen_start or has_start

    def split_text_delta(
        self, text: str, pending: str, seen_start: bool, *, finished: bool
    ) -> tuple[str | None, str | None, bool, bool, str]:
        """:meth:`split_delta` for text markers: ``(reasoning, content, ended, seen_start,
        pending)``. A marker may span chunks, so a tail that could begin one is held back in
        ``pending`` (at most ``len("</think>") - 1`` characters) until the next chunk decides
        it; the first ``<think>`` is dropped; the end of the stream flushes what is held."""
        buf = pending + text
        if not seen_start:
            s_idx, e_idx = buf.find(self.start), buf.find(self.end)
            if s_idx != -1 and (e_idx == -1 or s_idx < e_idx):
                buf = buf[:s_idx] + buf[s_idx + len(self.start) :]
                seen_start = True
        idx = buf.find(self.end)
        if idx != -1:
            content = buf[idx + len(self.end) :]
            return buf[:idx] or None, content or None, True, True, ""
        if finished:
            return buf or None, None, False, seen_start, ""
        markers = (self.end,) if seen_start else (self.end, self.start)
        keep = max((n for m in markers for n in range(1, len(m)) if buf.endswith(m[:n])), default=0)
        cut = len(buf) - keep
        return buf[:cut] or None, None, False, seen_start, buf[cut:]
