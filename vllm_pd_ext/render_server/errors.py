"""One error tree for the render server and its mapping to OpenAI error bodies.

Everything a client can get wrong becomes a :class:`RenderError` (HTTP 400 unless said
otherwise); the app turns it into ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from http import HTTPStatus
from typing import Any

#: Longest message we put in an error body (validation errors can be huge).
MAX_MESSAGE_CHARS = 2000


class RenderError(Exception):
    """A request the server refuses; carries the HTTP status and the OpenAI error fields."""

    def __init__(
        self,
        message: str,
        *,
        status: int = HTTPStatus.BAD_REQUEST,
        err_type: str = "BadRequestError",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = int(status)
        self.err_type = err_type
        self.param = param


#: The ``type`` vLLM gives a body that is not JSON or fails the request schema: its
#: ``RequestValidationError`` handler answers with the HTTP reason phrase, "Bad Request"; its
#: own checks on a valid body answer "BadRequestError".
SCHEMA_ERROR_TYPE = HTTPStatus.BAD_REQUEST.phrase


class SchemaError(RenderError):
    """A body that is not JSON or does not fit the route's schema (400, typed as vLLM's
    request-validation errors; ``param`` is the path from ``body``, as vLLM gives it)."""

    def __init__(self, message: str, *, param: str | None = "body") -> None:
        super().__init__(message, err_type=SCHEMA_ERROR_TYPE, param=param)


class ModelNotFoundError(RenderError):
    """The request names a model this server does not serve (404, as vLLM answers)."""

    def __init__(self, model: str) -> None:
        super().__init__(
            f"The model `{model}` does not exist.",
            status=HTTPStatus.NOT_FOUND,
            err_type="NotFoundError",
            param="model",
        )


def error_body(
    message: str, *, err_type: str = "BadRequestError", param: str | None = None, code: int = 400
) -> dict[str, Any]:
    """The OpenAI error body, with the message cut to :data:`MAX_MESSAGE_CHARS`."""
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[: MAX_MESSAGE_CHARS - 3] + "..."
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def body_for(exc: RenderError) -> dict[str, Any]:
    """The OpenAI error body for ``exc``."""
    return error_body(exc.message, err_type=exc.err_type, param=exc.param, code=exc.status)


def _param_segment(part: Any) -> bool:
    """Whether a pydantic ``loc`` part names a field or index a client would recognise (not
    a union branch such as ``list[int]`` or a validator kind), as vLLM filters them."""
    text = str(part)
    return not any(c in text for c in "[]{}()") and text.lower() not in _INTERNAL_LOC_PARTS


#: pydantic-core schema kinds that appear in ``loc`` for unions and wrapped validators.
_INTERNAL_LOC_PARTS = frozenset(
    {
        *("function-wrap", "function-after", "function-before", "function-plain"),
        *("json-or-python", "lax-or-strict", "chain", "default", "nullable", "tagged-union"),
        *("union", "call", "arguments", "is-instance", "is-subclass", "callable"),
        *("str", "int", "float", "bool", "bytes", "bytearray", "list", "tuple", "dict"),
        *("set", "frozenset", "complex", "none", "nonetype"),
    }
)


def validation_message(
    errors: Sequence[Mapping[str, Any]], prefix: str = "body"
) -> tuple[str, str | None]:
    """A bounded, readable message and the first offending parameter for pydantic errors.

    The parameter is the path from ``prefix`` (``body.messages``, ``body.prompt``), union
    branches and validator kinds left out, as vLLM's request-validation handler spells it.
    """
    lines = []
    param = None
    for err in errors[:10]:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p not in ("body",))
        if param is None:
            parts = [str(p) for p in err.get("loc", ()) if p != "body" and _param_segment(p)]
            param = ".".join([prefix, *parts])
        lines.append(f"{loc or 'body'}: {err.get('msg', 'invalid value')}")
    more = len(errors) - 10
    if more > 0:
        lines.append(f"... and {more} more")
    count = len(errors)
    head = f"{count} validation error{'s' if count != 1 else ''}"
    return head + ":\n  " + "\n  ".join(lines), param
