"""The multi-turn segment cache returns exactly the ids of a full tokenization."""

from __future__ import annotations

import random

import pytest

from vllm_pd_ext.render_server.protocol import ChatCompletionRequest
from vllm_pd_ext.render_server.renderer import Renderer
from vllm_pd_ext.render_server.segment_cache import SegmentCache, supports_segment_cache
from vllm_pd_ext.render_server.settings import RenderSettings
from vllm_pd_ext.render_server.tokenizer import load_tokenizer

WORDS = ["hello", "world", "Grüße", "東京", "🎉", "  spaces ", "\n\n", "tab\t", "x" * 70, "don't"]


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(WORDS) + rng.choice(["", " ", "\n"]) for _ in range(n))


@pytest.mark.parametrize("name", ["tiny_qwen", "tiny_llama"])
def test_multi_turn_ids_equal_full_encode_and_reuse_history(name, request):
    model = request.getfixturevalue(name)
    tok = load_tokenizer(model, None)
    assert supports_segment_cache(tok.backend)
    renderer = Renderer(RenderSettings(model=str(model), max_model_len=100_000), tok)
    rng = random.Random(7)
    messages = [{"role": "system", "content": _text(rng, 30)}]
    cache = tok.segment_cache
    assert isinstance(cache, SegmentCache)
    for turn in range(10):
        messages.append({"role": "user", "content": _text(rng, 40)})
        req = ChatCompletionRequest(messages=list(messages))
        text = renderer.render_chat_text(req)
        hits_before = cache.hits
        ids = renderer.render_chat(req)["token_ids"]
        assert ids == tok.backend.encode(text, add_special_tokens=False).ids
        if turn > 0:
            assert cache.hits > hits_before  # earlier turns came from the cache
        messages.append({"role": "assistant", "content": _text(rng, 25)})


def test_cache_is_bounded(tiny_qwen):
    tok = load_tokenizer(tiny_qwen, None)
    cache = SegmentCache(tok.backend, max_bytes=4000)
    for i in range(50):
        text = f"<|im_start|>user\n{i} " + "word " * 40 + "<|im_end|>"
        assert cache.encode(text) == tok.backend.encode(text, add_special_tokens=False).ids
    assert 0 < cache.bytes <= 4000


def test_the_bound_is_what_the_cache_really_holds(tiny_qwen):
    """Filled far past its bound with distinct segments, the cache holds no more memory than
    its bound says (measured with tracemalloc, not estimated): ids are packed, not ints."""
    import tracemalloc

    tok = load_tokenizer(tiny_qwen, None)
    bound = 2 << 20
    cache = SegmentCache(tok.backend, max_bytes=bound)
    rng = random.Random(3)
    texts = [
        "<|im_start|>user\n" + _text(rng, 60) + f" {i}<|im_end|>" for i in range(1500)
    ]  # ~4x the bound in entries
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for text in texts:
            cache.encode(text)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert cache.bytes <= bound
    assert held <= 1.25 * bound, f"{held} bytes held for a bound of {bound}"
