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


def validation_message(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str | None]:
    """A bounded, readable message and the first offending parameter for pydantic errors."""
    lines = []
    param = None
    for err in errors[:10]:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p not in ("body",))
        if param is None and loc:
            param = loc
        lines.append(f"{loc or 'body'}: {err.get('msg', 'invalid value')}")
    more = len(errors) - 10
    if more > 0:
        lines.append(f"... and {more} more")
    count = len(errors)
    head = f"{count} validation error{'s' if count != 1 else ''}"
    return head + ":\n  " + "\n  ".join(lines), param
