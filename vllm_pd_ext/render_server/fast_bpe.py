"""A tiktoken fast path for byte-level BPE tokenizers (Qwen2/2.5, Llama-3, GPT-2 style).

The Rust ``tokenizers`` encode of a 9k-token prompt is most of a render request's CPU. For a
byte-level BPE tokenizer whose ranks follow its merges (every tokenizer converted from a
tiktoken vocabulary is one), ``tiktoken`` computes the same ids about four times faster: same
split regex, same byte-level BPE, the merge priority being the id of the merged token.

:func:`build_fast_bpe` builds a ``tiktoken.Encoding`` from the tokenizer's own ``tokenizer.json``
(vocabulary with the byte-level mapping undone, pre-tokenizer regex) and enables it only when

* the structure matches exactly: a ``BPE`` model without dropout, word prefixes/suffixes or
  byte fallback; tiktoken takes a piece found in the vocabulary whole, so either the model does
  too (``ignore_merges``) or its merges rebuild every vocabulary token from its bytes (checked);
  a byte-level pre-tokenizer (``ByteLevel`` with its GPT-2 regex, or one ``Split`` regex with
  ``Isolated`` behaviour followed by ``ByteLevel`` without regex), no prefix space; no
  normalizer or a Unicode normal form; all 256 bytes in the vocabulary; merges that are exactly
  every split of a token into two tokens, ordered by the id of the merged token (so HF's merge
  order is tiktoken's rank order);
* and a self-check over a varied built-in corpus (ASCII prose, code, whitespace runs, digits,
  CJK, emoji, combining marks, random code points, random bytes as text, the vocabulary's own
  tokens, and every input where the two could break a tie differently, see
  :func:`overlapping_split_texts`) gives ids identical to the HF tokenizer.

Otherwise it returns None (INFO log saying why) and the caller keeps the HF tokenizer.

The fast path encodes *ordinary* text only: the caller cuts added tokens out first, as the HF
tokenizer does (see :mod:`.segment_cache`). A normalizer is applied with the tokenizer's own
Rust normalizer (``normalize_str``), skipped for ASCII text (on which every Unicode normal form
is the identity), so normalization is exactly HF's whatever the Unicode versions involved.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import random
import re
import time
from collections.abc import Callable, Iterable
from typing import Any

from vllm_pd_ext.util.hf_encode import encode_ids

logger = logging.getLogger(__name__)

#: The regex of ``pre_tokenizers.ByteLevel(use_regex=True)`` (GPT-2's), as in ``tokenizers``.
BYTE_LEVEL_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

#: Normalizers the fast path applies (with the tokenizer's own ``normalize_str``).
_UNICODE_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD"})


class NotApplicable(Exception):
    """The tokenizer is not one the fast path reproduces exactly; the message says why."""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


class FastBPE:
    """Ids of ordinary text (no added tokens) with tiktoken, identical to the HF tokenizer's."""

    def __init__(self, encoding: Any, normalize: Callable[[str], str] | None) -> None:
        self.encoding = encoding
        self._encode = encoding._core_bpe.encode_ordinary
        self._normalize = normalize

    def encode(self, text: str) -> list[int]:
        if self._normalize is not None and not text.isascii():
            text = self._normalize(text)
        try:
            return self._encode(text)
        except UnicodeEncodeError:  # lone surrogates: tiktoken's own fix-up
            return self.encoding.encode_ordinary(text)

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]


def _pattern(pre: dict[str, Any] | None) -> str:
    """The split regex of a byte-level pre-tokenizer config, or NotApplicable."""
    if pre is None:
        raise NotApplicable("no pre-tokenizer")
    kind = pre.get("type")
    if kind == "ByteLevel":
        if pre.get("add_prefix_space") or not pre.get("use_regex", True):
            raise NotApplicable("ByteLevel pre-tokenizer with a prefix space or without regex")
        return BYTE_LEVEL_PATTERN
    if kind == "Sequence":
        steps = pre.get("pretokenizers") or []
        if len(steps) == 2:
            split, byte_level = steps
            if (
                split.get("type") == "Split"
                and split.get("behavior") == "Isolated"
                and not split.get("invert")
                and isinstance(split.get("pattern"), dict)
                and "Regex" in split["pattern"]
                and byte_level.get("type") == "ByteLevel"
                and not byte_level.get("add_prefix_space")
                and not byte_level.get("use_regex", True)
            ):
                return split["pattern"]["Regex"]
    raise NotApplicable(f"pre-tokenizer {json.dumps(pre)[:200]} is not a known byte-level split")


def _normalizer(config: dict[str, Any] | None, backend: Any) -> Callable[[str], str] | None:
    if config is None:
        return None
    kinds = (
        [n.get("type") for n in config.get("normalizers") or []]
        if config.get("type") == "Sequence"
        else [config.get("type")]
    )
    if not kinds or not all(k in _UNICODE_NORMALIZERS for k in kinds):
        raise NotApplicable(f"normalizer {kinds} is not a Unicode normal form")
    return backend.normalizer.normalize_str


def _ranks(model: dict[str, Any], backend: Any) -> dict[bytes, int]:
    """tiktoken's mergeable ranks (token bytes -> id) of a BPE model, checked for equivalence."""
    if model.get("type") != "BPE":
        raise NotApplicable(f"model type {model.get('type')} is not BPE")
    if model.get("dropout") or model.get("byte_fallback"):
        raise NotApplicable("BPE with dropout or byte fallback")
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        raise NotApplicable("BPE with a subword prefix or word suffix")
    # byte-level characters -> the bytes they stand for; any other character -> one that
    # latin-1 cannot encode, so a token holding it fails below
    table: dict[int, int] = dict.fromkeys(range(256), 0x10000)
    table.update({ord(c): b for b, c in bytes_to_unicode().items()})
    vocab: dict[str, int] = model["vocab"]
    try:
        ranks = {token.translate(table).encode("latin-1"): tid for token, tid in vocab.items()}
    except UnicodeEncodeError:
        raise NotApplicable("the vocabulary holds tokens that are not byte-level") from None
    if len(ranks) != len(vocab) or any(bytes([b]) not in ranks for b in range(256)):
        raise NotApplicable("the vocabulary lacks some single bytes")
    merges = model.get("merges") or []
    pairs = [m.split(" ", 1) if isinstance(m, str) else m for m in merges]
    merged_ids = [vocab.get(left + right, -1) for left, right in pairs]
    if any(i < 0 for i in merged_ids) or any(
        left not in vocab or right not in vocab for left, right in pairs
    ):
        raise NotApplicable("a merge is not made of vocabulary tokens")
    if any(a > b for a, b in itertools.pairwise(merged_ids)):
        raise NotApplicable("merges are not in the order of their merged token ids")
    seen = {(left, right) for left, right in pairs}
    if len(seen) != len(pairs):
        raise NotApplicable("repeated merges")
    # Every split of a vocabulary token into two vocabulary tokens must be a merge (tiktoken
    # joins any adjacent pair whose concatenation it knows). The merges are such splits and
    # distinct, so equal counts mean equal sets.
    count = 0
    for token in vocab:
        for i in range(1, len(token)):
            if token[:i] in vocab and token[i:] in vocab:
                count += 1
    if count != len(seen):
        raise NotApplicable(
            f"{count - len(seen)} splits of vocabulary tokens into two tokens have no merge"
        )
    if not model.get("ignore_merges"):
        # tiktoken takes a piece found in the vocabulary whole; HF without ignore_merges runs
        # the merges on it, which must then lead to that very token
        tokenize = backend.model.tokenize
        for token, tid in vocab.items():
            if len(token) > 1:
                out = tokenize(token)
                if len(out) != 1 or out[0].id != tid:
                    raise NotApplicable(f"the merges do not rebuild vocabulary token {token!r}")
    return ranks


def check_corpus(seed: int = 0, vocab_tokens: list[bytes] | None = None) -> list[str]:
    """Varied texts the fast path must encode exactly as HF does (deterministic for ``seed``)."""
    rng = random.Random(seed)
    texts = [
        "Hello, world! It's a test; don't panic. I'M SURE they'LL say 'yes' & 'No'.",
        "def f(x):\n    return x**2  # square\n\n\nclass A:\n\tpass\r\n",
        "   leading and trailing spaces   \n\n\n  \t \t\n   \r\n\r\n  x  ",
        "numbers 0 1 12 123 1234 12345 3.14159 -42 1e10 0x1F ٣٤٥ ١٢ ²³ ½ Ⅻ",
        "中文测试：你好，世界。日本語のテキスト、カタカナ。한국어 텍스트입니다.",  # noqa: RUF001
        "emoji 🎉🎉 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 ❤️ 🇩🇪 ✨ text🙂more",
        "combining: e\u0301 a\u0308 o\u0302\u0323 n\u0303 \u0915\u094d\u0937 \u05e9\u05c1",
        "Ünïcödé façade naïve coöperate Å Ω Ж ж ß ẞ İı ǅ ﬁ ＡＢＣ",  # noqa: RUF001
        "Arabic العربية Hebrew עברית Thai ภาษาไทย Hindi हिन्दी Greek Ελληνικά",
        "controls \x00\x01\x07\x1b[0m \x7f \u200b\u200c\u200d\ufeff \u2028\u2029 \x85 \xa0 \u3000",
        "'s's 's 'S 'T 're 'RE 've 'm 'll 'd ''' \"'\" ' s",
        "URLs https://example.com/a?b=c&d=e#f and emails a.b@c.de, paths C:\\x\\y /usr/bin",
        '<html><body class="x">&amp; &lt;tag&gt;</body></html> {"json": [1, 2, null]}',
    ]
    # whitespace and punctuation runs of every length up to 12
    for ch in (" ", "\n", "\t", "\r\n", "\u3000", "!", ".", "-", "="):
        texts.append("a" + "".join(ch * n + "b" for n in range(1, 13)))
    # random code points from all planes (no surrogates), in short random runs
    for _ in range(40):
        parts = []
        for _ in range(rng.randint(5, 60)):
            plane = rng.choice((0x7F, 0x800, 0x3000, 0x10000, 0x20000, 0x110000))
            cp = rng.randrange(plane)
            if 0xD800 <= cp <= 0xDFFF:
                cp = 0xFFFD
            parts.append(chr(cp) * rng.choice((1, 1, 2, 3)) + rng.choice(("", "", " ", "\n", "a")))
        texts.append("".join(parts))
    # random bytes as text (latin-1 and lossy UTF-8)
    for _ in range(20):
        raw = bytes(rng.randrange(256) for _ in range(rng.randint(10, 200)))
        texts.append(raw.decode("latin-1"))
        texts.append(raw.decode("utf-8", errors="replace"))
    # a long mixed text
    words = [t for text in texts[:13] for t in text.split(" ") if t]
    texts.append(" ".join(rng.choice(words) for _ in range(3000)))
    # the vocabulary's own tokens, glued and separated
    if vocab_tokens:
        sample = rng.sample(vocab_tokens, min(3000, len(vocab_tokens)))
        decoded = [t.decode("utf-8", errors="replace") for t in sample]
        texts.append("".join(decoded))
        texts.append(" ".join(decoded))
    return texts


def overlapping_split_texts(ranks: dict[bytes, int]) -> list[str]:
    """Texts where HF and tiktoken could break a tie differently, to check they do not.

    The two differ only in ties between *different* splits of one token T that are adjacent
    pairs at the same time: HF takes the split listed first among the merges, tiktoken the
    leftmost pair. Overlapping ones come from a token with a border, T = x+y = y+z with x, y,
    z tokens: the bytes x+y+z hold both (x, y) and (y, z). Each such input, alone and after a
    space.
    """
    texts = []
    for token in ranks:
        n = len(token)
        for k in range(1, n):
            y = token[:k]
            if token.endswith(y) and token[: n - k] in ranks and y in ranks and token[k:] in ranks:
                text = (token[: n - k] + token).decode("utf-8", errors="replace")
                texts += [text, " " + text]
    return texts


def build_fast_bpe(
    backend: Any, *, exclude: re.Pattern[str] | None = None, corpus: list[str] | None = None
) -> FastBPE | None:
    """The tiktoken fast path for the Rust tokenizer ``backend``, or None when not exact.

    ``exclude`` matches the added tokens (the fast path never sees them); pieces of the check
    corpus are cut at its matches. ``corpus`` replaces the built-in check corpus (tests).
    """
    started = time.perf_counter()
    config_text = backend.to_str()
    key = hashlib.sha256(
        f"{exclude.pattern if exclude else ''}\0{config_text}".encode()
    ).hexdigest()
    if corpus is None and key in _VERDICTS:  # same tokenizer again in this process
        fast, message = _VERDICTS[key]
        logger.info("%s (checked earlier in this process)", message)
        return fast
    fast, message = _checked(backend, config_text, exclude, corpus, started)
    logger.info("%s", message)
    if corpus is None:
        _VERDICTS[key] = (fast, message)
    return fast


#: Fast paths (or None) already built and checked in this process, by tokenizer config and
#: added tokens, with the log line that said why.
_VERDICTS: dict[str, tuple[FastBPE | None, str]] = {}


def _checked(
    backend: Any,
    config_text: str,
    exclude: re.Pattern[str] | None,
    corpus: list[str] | None,
    started: float,
) -> tuple[FastBPE | None, str]:
    off = "fast BPE path off (HF tokenizer used): "
    try:
        fast = _build(backend, config_text)
    except NotApplicable as exc:
        return None, f"{off}{exc}"
    except Exception as exc:  # e.g. a regex tiktoken cannot compile
        return None, f"{off}{type(exc).__name__}: {exc}"
    if corpus is None:
        ranks = fast.encoding._mergeable_ranks
        corpus = check_corpus(0, list(ranks)) + overlapping_split_texts(ranks)
    pieces = _pieces(corpus, exclude)
    mismatch = first_mismatch(fast, backend, pieces)
    if mismatch is not None:
        return None, f"{off}self-check differs from HF on {mismatch[:80]!r}"
    elapsed = time.perf_counter() - started
    return (
        fast,
        f"fast BPE path on (tiktoken; self-check of {len(pieces)} texts passed in {elapsed:.2f} s)",
    )


def first_mismatch(fast: FastBPE, backend: Any, texts: list[str]) -> str | None:
    """The first text whose fast ids differ from the HF tokenizer's, or None."""
    expected = encode_ids(backend, texts, add_special_tokens=False)
    for text, ids in zip(texts, expected, strict=True):
        if fast.encode(text) != ids:
            return text
    return None


def _pieces(texts: list[str], exclude: re.Pattern[str] | None) -> list[str]:
    if exclude is None:
        return [t for t in texts if t]
    return [p for t in texts for p in exclude.split(t) if p and not exclude.fullmatch(p)]


def _build(backend: Any, config_text: str) -> FastBPE:
    import tiktoken

    config = json.loads(config_text)
    if config.get("truncation") or config.get("padding"):
        raise NotApplicable("truncation or padding configured")
    pattern = _pattern(config.get("pre_tokenizer"))
    normalize = _normalizer(config.get("normalizer"), backend)
    ranks = _ranks(config["model"], backend)
    encoding = tiktoken.Encoding(
        "vllm-pd-render-fast-bpe", pat_str=pattern, mergeable_ranks=ranks, special_tokens={}
    )
    return FastBPE(encoding, normalize)
