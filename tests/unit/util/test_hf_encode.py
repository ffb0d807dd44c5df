"""``encode_ids``: the ids a real ``tokenizers.Tokenizer`` makes, on either of its batch calls."""

from __future__ import annotations

import pytest
import tokenizers

from vllm_pd_ext.util.hf_encode import encode_ids

TEXTS = ["the cat sat", "", "a cat the mat unknown"]


@pytest.fixture
def backend():
    """A word-level tokenizer with a [CLS] post-processor, built in memory."""
    vocab = {"[UNK]": 0, "[CLS]": 1, "the": 2, "cat": 3, "sat": 4, "a": 5, "mat": 6}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="[CLS] $A", special_tokens=[("[CLS]", 1)]
    )
    return tok


class OnlyEncodeBatch:
    """A tokenizer as releases before ``encode_batch_fast`` had it: ``encode_batch`` only."""

    def __init__(self, tok) -> None:
        self.encode_batch = tok.encode_batch


def test_ids_without_special_tokens(backend):
    assert encode_ids(backend, TEXTS, add_special_tokens=False) == [[2, 3, 4], [], [5, 3, 2, 6, 0]]


def test_ids_with_special_tokens(backend):
    assert encode_ids(backend, TEXTS, add_special_tokens=True) == [
        [1, 2, 3, 4],
        [1],
        [1, 5, 3, 2, 6, 0],
    ]


@pytest.mark.parametrize("special", [False, True])
def test_a_tokenizer_without_the_fast_call_gives_the_same_ids(backend, special):
    assert encode_ids(OnlyEncodeBatch(backend), TEXTS, add_special_tokens=special) == encode_ids(
        backend, TEXTS, add_special_tokens=special
    )
