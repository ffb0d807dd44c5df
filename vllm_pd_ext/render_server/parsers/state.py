"""The declared shape of each parser's carried streaming state, and the bounds it is held to.

A streaming client carries ``stream_state.parser_state`` from one derender call to the next, so
the server reads back whatever the client sends. Every parser that carries state declares its
shape once, as a :class:`ParserState` model next to the parser (the keys, their types, and
their bounds); derender checks a carried state against the configured parser's model before
the parser reads it. No key is coerced (strict types) and none is added (``extra="forbid"``).

The bounds come from what one real output can produce, :class:`StateLimits`:

* text a parser holds (a call being read, whitespace held back) is part of the output, and an
  output of ``max_model_len`` tokens decodes to at most ``max_model_len`` times the longest
  token's text (the bound render already applies to a prompt's text);
* counts of calls, chunks and tokens are at most ``max_model_len`` (each takes a token);
* a partial marker or special-token text held over a chunk boundary is shorter than the
  marker (a fixed bound declared with the field) or than the longest token.

Checking costs O(size of the state): the keys, each string's length and each list's items.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo

__all__ = [
    "Count",
    "Index",
    "Items",
    "Length",
    "ParserState",
    "StateLimits",
    "Text",
    "TokenText",
    "check_state",
    "limits_of",
]


@dataclass(frozen=True)
class StateLimits:
    """Bounds on a carried state, from the model's context length and its tokenizer."""

    #: the most characters any text in a state may hold: what ``max_tokens`` tokens decode to
    max_text: int
    #: the most calls, chunks or token ids a state may count or list: ``max_model_len``
    max_tokens: int
    #: the longest text one token decodes to (a special token's text held over a boundary)
    max_token_text: int

    @classmethod
    def for_model(cls, max_model_len: int, max_chars_per_token: int) -> StateLimits:
        """The limits for a model of ``max_model_len`` tokens whose longest token string is
        ``max_chars_per_token`` characters (``TokenizerInfo.max_chars_per_token``)."""
        return cls(
            max_text=max_model_len * max_chars_per_token,
            max_tokens=max_model_len,
            max_token_text=max_chars_per_token,
        )


class ParserState(BaseModel):
    """Base of every parser's state shape: strict types, no unknown keys, read-only."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def limits_of(info: ValidationInfo) -> StateLimits:
    """The limits a check runs within (for a shape's own validators)."""
    limits = info.context
    if not isinstance(limits, StateLimits):  # a shape checked without limits: our mistake
        raise TypeError("parser state checked without StateLimits")
    return limits


def _text(value: str, info: ValidationInfo) -> str:
    limit = limits_of(info).max_text
    if len(value) > limit:
        raise ValueError(f"longer than {limit} characters (the text of the longest output)")
    return value


def _token_text(value: str, info: ValidationInfo) -> str:
    limit = limits_of(info).max_token_text
    if len(value) > limit:
        raise ValueError(f"longer than {limit} characters (the text of the longest token)")
    return value


def _count(value: int, info: ValidationInfo) -> int:
    limit = limits_of(info).max_tokens
    if value > limit:
        raise ValueError(f"greater than {limit} (the longest output in tokens)")
    return value


def _length(value: int, info: ValidationInfo) -> int:
    limit = limits_of(info).max_text
    if value > limit:
        raise ValueError(f"greater than {limit} (the text of the longest output)")
    return value


def _few(value: Any, info: ValidationInfo) -> Any:
    # before the items are validated: a huge list is refused without reading it
    limit = limits_of(info).max_tokens
    if isinstance(value, list) and len(value) > limit:
        raise ValueError(f"more than {limit} items (the longest output in tokens)")
    return value


#: Text held from the output (a call being read): at most the text of the longest output.
Text = Annotated[str, AfterValidator(_text)]
#: A special token's text, or part of one: at most the longest token's text.
TokenText = Annotated[str, AfterValidator(_token_text)]
#: A count or index of calls, chunks or tokens: 0 to ``max_tokens``.
Count = Annotated[int, Field(ge=0), AfterValidator(_count)]
#: A count of characters (a nesting depth): 0 to ``max_text``.
Length = Annotated[int, Field(ge=0), AfterValidator(_length)]
#: An index of JSON elements, -1 for none yet: at most one element per character.
Index = Annotated[int, Field(ge=-1), AfterValidator(_length)]

_Item = TypeVar("_Item")
#: A list of at most ``max_tokens`` items (one per chunk or token).
Items = Annotated[list[_Item], BeforeValidator(_few)]


def check_state(model: type[ParserState], state: Any, limits: StateLimits) -> None:
    """Check ``state`` against ``model`` within ``limits``; raise ``pydantic.ValidationError``
    naming every mismatch. Runs in the derender call, before the parser reads the state."""
    model.model_validate(state, context=limits)
