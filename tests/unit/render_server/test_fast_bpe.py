"""The tiktoken fast path gives exactly the HF tokenizer's ids, or stays off."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from vllm_pd_ext.render_server import fast_bpe
from vllm_pd_ext.render_server.fast_bpe import (
    BYTE_LEVEL_PATTERN,
    FastBPE,
    build_fast_bpe,
    check_corpus,
    overlapping_split_texts,
)
from vllm_pd_ext.render_server.parsers.reasoning import ThinkReasoningParser
from vllm_pd_ext.render_server.tokenizer import load_tokenizer

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

WORDS = [
    "hello", "World", "don't", "I'LL", "東京都", "🎉", "👨‍👩‍👧", "e\u0301", "Ωμέγα", "١٢٣",
    "12345678", "  ", "\n", "\r\n", "\t", "\u3000", "<tag>", "x" * 40, "...", "ﬁ", "Å",
]  # fmt: skip


def random_texts(seed: int, count: int) -> list[str]:
    """Seeded texts mixing words, separators, random code points and long runs."""
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(1, 300)):
            r = rng.random()
            if r < 0.7:
                parts.append(rng.choice(WORDS))
            elif r < 0.9:
                cp = rng.randrange(0x110000)
                parts.append(chr(0xFFFD if 0xD800 <= cp <= 0xDFFF else cp))
            else:
                parts.append(rng.choice(" \n\t.,;!?-'\"") * rng.randint(1, 8))
            parts.append(rng.choice(("", "", " ", "\n")))
        texts.append("".join(parts))
    return texts


@pytest.fixture(autouse=True)
def _fresh_verdicts(monkeypatch):
    """Each test checks its tokenizer itself (the process-wide verdict cache starts empty)."""
    monkeypatch.setattr(fast_bpe, "_VERDICTS", {})


def _hf_ids(backend, texts: list[str], special: bool = False) -> list[list[int]]:
    return [e.ids for e in backend.encode_batch(texts, add_special_tokens=special)]


@pytest.fixture(scope="module")
def qwen(tiny_qwen):
    tok = load_tokenizer(tiny_qwen, None)
    assert tok.fast_bpe is not None  # Qwen2.5's BPE: the fast path is on
    return tok


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_qwen_randomized_corpus_identical(qwen, seed):
    texts = random_texts(seed, 60) + check_corpus(seed)
    pieces = [p for t in texts for p in qwen.segment_cache.splitter.split(t)[::2] if p]
    expected = _hf_ids(qwen.backend, pieces)
    assert [qwen.fast_bpe.encode(p) for p in pieces] == expected


def test_qwen_long_texts_and_added_tokens_identical(qwen):
    long_texts = ["".join(random_texts(seed, 40)) for seed in (10, 11)]  # ~100k chars each
    assert min(map(len, long_texts)) > 20_000
    with_added = [
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n" + long_texts[0],
        'a<tool_call>{"x": 1}</tool_call><|endoftext|>' + long_texts[1][:5000] + "<|im_end|>",
    ]
    texts = long_texts + with_added
    for special in (False, True):
        expected = _hf_ids(qwen.backend, texts, special)
        assert qwen.encode_batch(texts, add_special_tokens=special) == expected
        assert [qwen.encode(t, add_special_tokens=special) for t in texts] == expected


def test_qwen_every_code_point_identical(qwen):
    """Each code point (no surrogates) alone, in runs and between letters, digits, spaces:
    the two regex engines' Unicode tables and the normalizer path agree everywhere."""
    cps = [c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
    texts = []
    for i in range(0, len(cps), 2048):
        block = cps[i : i + 2048]
        texts.append("".join(map(chr, block)))
        texts.append("".join(f"a{chr(c)}1{chr(c)}{chr(c)} " for c in block))
    expected = _hf_ids(qwen.backend, texts)
    mismatched = [
        t[:20] for t, e in zip(texts, expected, strict=True) if qwen.fast_bpe.encode(t) != e
    ]
    assert mismatched == []


def _variant(tiny_qwen, pre_tokenizer=None, normalizer="keep") -> Tokenizer:
    """tiny-qwen's tokenizer with another pre-tokenizer and/or normalizer."""
    config = json.loads((Path(tiny_qwen) / "tokenizer.json").read_text())
    if pre_tokenizer is not None:
        config["pre_tokenizer"] = pre_tokenizer
    if normalizer != "keep":
        config["normalizer"] = normalizer
    return Tokenizer.from_str(json.dumps(config))


def _split_then_byte_level(pattern: str, behavior: str = "Isolated") -> dict:
    return {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": behavior, "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False,
             "trim_offsets": True},
        ],
    }  # fmt: skip


@pytest.mark.parametrize(
    "pre_tokenizer",
    [
        _split_then_byte_level(LLAMA3_PATTERN),  # Llama-3's split
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ],
    ids=["llama3-regex", "gpt2-byte-level"],
)
def test_other_byte_level_pre_tokenizers_identical(tiny_qwen, pre_tokenizer):
    backend = _variant(tiny_qwen, pre_tokenizer, normalizer={"type": "NFC"})
    fast = build_fast_bpe(backend)
    assert fast is not None
    texts = random_texts(5, 40) + check_corpus(5)
    assert [fast.encode(t) for t in texts] == _hf_ids(backend, texts)
    if pre_tokenizer["type"] == "ByteLevel":
        assert fast.encoding._pat_str == BYTE_LEVEL_PATTERN


def test_tiny_llama_falls_back_and_stays_exact(tiny_llama, caplog):
    """tiny-llama is byte-level BPE but trained by ``tokenizers``: its merges are not every
    split of its tokens, so tiktoken could merge differently; the fast path stays off."""
    with caplog.at_level(logging.INFO, logger="vllm_pd_ext.render_server.fast_bpe"):
        tok = load_tokenizer(tiny_llama, None)
        assert tok.fast_bpe is None
    assert "have no merge" in caplog.text
    texts = [*random_texts(7, 20), "<|begin_of_text|>hi<|eot_id|>", ""]
    for special in (False, True):
        assert tok.encode_batch(texts, add_special_tokens=special) == _hf_ids(
            tok.backend, texts, special
        )
    assert tok.special_affixes == ([tok.token_id("<|begin_of_text|>")], [])


@pytest.mark.parametrize(
    ("pre_tokenizer", "normalizer", "reason"),
    [
        (_split_then_byte_level(r"\X"), "keep", "Invalid escape"),  # onig-only \X
        (_split_then_byte_level(LLAMA3_PATTERN, "Removed"), "keep", "not a known byte-level"),
        (None, {"type": "Lowercase"}, "not a Unicode normal form"),
        (
            {
                "type": "ByteLevel",
                "add_prefix_space": True,
                "trim_offsets": True,
                "use_regex": True,
            },
            "keep",
            "prefix space",
        ),
    ],
    ids=["unknown-regex-syntax", "split-removed", "lowercase-normalizer", "prefix-space"],
)
def test_unknown_regex_or_normalizer_falls_back(
    tiny_qwen, caplog, pre_tokenizer, normalizer, reason
):
    backend = _variant(tiny_qwen, pre_tokenizer, normalizer)
    with caplog.at_level(logging.INFO, logger="vllm_pd_ext.render_server.fast_bpe"):
        assert build_fast_bpe(backend) is None
    assert reason in caplog.text


def test_self_check_mismatch_falls_back(tiny_qwen, monkeypatch, caplog):
    """A regex both engines compile but that splits differently from the encoder we build
    (here: the encoder is given the wrong pattern) is caught by the self-check."""
    backend = _variant(tiny_qwen, normalizer=None)
    real_init = FastBPE.__init__

    def wrong_pattern(self, encoding, normalize):
        import tiktoken

        wrong = tiktoken.Encoding(
            "wrong", pat_str=BYTE_LEVEL_PATTERN, mergeable_ranks=encoding._mergeable_ranks,
            special_tokens={},
        )  # fmt: skip
        real_init(self, wrong, normalize)

    monkeypatch.setattr(FastBPE, "__init__", wrong_pattern)
    with caplog.at_level(logging.INFO, logger="vllm_pd_ext.render_server.fast_bpe"):
        assert build_fast_bpe(backend) is None
    assert "self-check differs" in caplog.text


def test_forced_off(tiny_qwen):
    import argparse

    from vllm_pd_ext.render_server.cli import add_parser, settings_from_args

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["render", str(tiny_qwen), "--no-fast-bpe"])
    settings = settings_from_args(args)
    assert settings.fast_bpe is False
    assert parser.parse_args(["render", str(tiny_qwen)]).fast_bpe is True
    tok = load_tokenizer(tiny_qwen, None, fast_bpe=settings.fast_bpe)
    assert tok.fast_bpe is None
    assert tok.segment_cache is not None  # the multi-turn cache still works, on HF ids
    text = "<|im_start|>user\n" + random_texts(3, 1)[0]
    assert tok.encode(text, add_special_tokens=False) == _hf_ids(tok.backend, [text])[0]


def test_prompt_ended_reasoning_matches_a_backwards_scan():
    class _Tok:
        def token_id(self, token):
            return {"<think>": 7, "</think>": 8}[token]

    parser = ThinkReasoningParser(_Tok())
    rng = random.Random(0)
    for _ in range(500):
        ids = [rng.choice((1, 2, 3, 7, 8)) for _ in range(rng.randint(0, 12))]
        expected = False
        for tid in reversed(ids):
            if tid in (7, 8):
                expected = tid == 8
                break
        assert parser.prompt_ended_reasoning(ids) is expected


def test_qwen_overlapping_splits_identical(qwen):
    """Where HF (merge order) and tiktoken (leftmost) could break a tie between two splits of
    one token differently: every such input of the vocabulary, in more contexts than the
    startup check uses."""
    texts = overlapping_split_texts(qwen.fast_bpe.encoding._mergeable_ranks)
    assert len(texts) > 1000  # Qwen2.5 has thousands of tokens with a border
    texts += ["a" + t for t in texts] + [t + t + "\n" for t in texts]
    expected = _hf_ids(qwen.backend, texts)
    fast = qwen.fast_bpe
    assert [t for t, e in zip(texts, expected, strict=True) if fast.encode(t) != e] == []


def test_verdict_is_reused_in_the_process(tiny_qwen, caplog):
    first = load_tokenizer(tiny_qwen, None).fast_bpe
    with caplog.at_level(logging.INFO, logger="vllm_pd_ext.render_server.fast_bpe"):
        assert load_tokenizer(tiny_qwen, None).fast_bpe is first
    assert "checked earlier in this process" in caplog.text
