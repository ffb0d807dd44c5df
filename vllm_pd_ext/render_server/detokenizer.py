"""Incremental detokenization with vLLM's algorithm and a client-carried window.

The state is ``(prev_tokens, prefix_offset, read_offset)`` as in vLLM's
``detokenize_incrementally``: text is released only once the tail decodes without a dangling
U+FFFD, so multi-byte characters split across tokens (or across chunks) come out whole. The
window is trimmed after every token, so each call costs O(new tokens), whatever came before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_pd_ext.render_server.tokenizer import TokenizerInfo

#: vLLM's ``INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET``.
INITIAL_OFFSET = 5


@dataclass
class DetokState:
    """The trailing decode window (token strings) and the two offsets into it."""

    prev_tokens: list[str] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0


def seed_state(
    tok: TokenizerInfo, prompt_token_ids: list[int] | None, *, skip_special_tokens: bool
) -> DetokState:
    """The initial window from the prompt tail, as the engine primes its detokenizer."""
    if not prompt_token_ids:
        return DetokState()
    tokens = tok.ids_to_tokens(
        list(prompt_token_ids[-INITIAL_OFFSET - 2 :]), skip_special_tokens=skip_special_tokens
    )
    read_offset = len(tokens)
    return DetokState(tokens, max(read_offset - INITIAL_OFFSET, 0), read_offset)


def detokenize(
    tok: TokenizerInfo,
    token_ids: list[int],
    state: DetokState,
    *,
    skip_special_tokens: bool,
) -> tuple[str, DetokState]:
    """Decode ``token_ids`` following ``state``; return the new text and the next state.

    ``state`` is not modified. Ids outside the vocabulary decode to nothing, as in vLLM.
    """
    prev = list(state.prev_tokens)
    prefix_offset = state.prefix_offset
    read_offset = state.read_offset
    size = tok.vocab_size
    special = tok.special_ids
    to_token = tok.backend.id_to_token
    to_string = tok.tokens_to_string
    parts: list[str] = []
    for tid in token_ids:
        if 0 <= tid < size:
            new = [] if skip_special_tokens and tid in special else [to_token(tid) or ""]
        else:
            new = [""]
        window_start = min(prefix_offset, read_offset, len(prev))
        output = (prev[window_start:] if window_start else prev) + new
        count = len(prev) + len(new)
        prefix_text = to_string(output[prefix_offset - window_start : read_offset - window_start])
        new_text = to_string(output[prefix_offset - window_start :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            parts.append(new_text[len(prefix_text) :])
            prefix_offset, read_offset = read_offset, count
        prev = (prev + new)[prefix_offset:]
        read_offset -= prefix_offset
        prefix_offset = 0
    return "".join(parts), DetokState(prev, prefix_offset, read_offset)


def token_strings(tok: TokenizerInfo, token_ids: list[int]) -> list[tuple[str, list[int] | None]]:
    """Each id's own string and UTF-8 bytes, as vLLM shows them in logprobs."""
    out: list[tuple[str, list[int] | None]] = []
    to_token = tok.backend.id_to_token
    for tid in token_ids:
        if to_token(tid) is None:
            out.append(("", None))
            continue
        text = tok.decode([tid]) or ""
        out.append((text, list(text.encode("utf-8", errors="replace"))))
    return out
