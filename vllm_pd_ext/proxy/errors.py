"""OpenAI-style error bodies, built in one place."""

from __future__ import annotations

import json
from http import HTTPStatus

from fastapi.responses import JSONResponse

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "BadRequestError",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


class ProxyError(Exception):
    """An error the proxy answers with an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
        err_type: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after
        #: the body's ``type``; None: the status's entry in ``_TYPES``
        self.err_type = err_type

    def body(self) -> dict:
        """The OpenAI error body it is answered with."""
        return error_body(self.status, self.message, self.param, self.code, err_type=self.err_type)

    def headers(self) -> dict[str, str]:
        """The answer's headers beyond the content type (``Retry-After``)."""
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, round(self.retry_after)))}

    @property
    def outcome(self) -> str:
        """The request's outcome label when it ends with this error: ``client_error`` for
        a 4xx, else the error's code."""
        if 400 <= self.status < 500:
            return "client_error"
        return self.code if isinstance(self.code, str) else "error"


#: The ``type`` vLLM gives a body that is not JSON or does not fit the request's schema (its
#: request-validation handler answers with the HTTP reason phrase); its own checks on a valid
#: body answer ``BadRequestError``.
SCHEMA_ERROR_TYPE = HTTPStatus.BAD_REQUEST.phrase


def schema_error(message: str, param: str) -> ProxyError:
    """A 400 for a body that is not JSON or does not fit the schema, typed as vLLM types it;
    ``param``: the path from ``body`` (``body.max_tokens``), as vLLM spells it."""
    return ProxyError(400, message, param=param, err_type=SCHEMA_ERROR_TYPE)


def error_body(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    *,
    err_type: str | None = None,
) -> dict:
    return {
        "error": {
            "message": message[:2000],
            "type": err_type or _TYPES.get(status, "APIError"),
            "param": param,
            "code": code or status,
        }
    }


def error_response(exc: ProxyError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())


def sse_error(status: int, message: str) -> bytes:
    """One SSE event carrying an error, for streams that fail after their headers."""
    return b"data: " + json.dumps(error_body(status, message)).encode() + b"\n\n"


def passthrough(status: int, raw: bytes) -> ProxyError:
    """An upstream's 4xx (engine or render server), forwarded with its own message, param and
    type (vLLM types a schema error "Bad Request", its own checks "BadRequestError")."""
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    data = data if isinstance(data, dict) else {}
    error = data.get("error")
    err: dict = error if isinstance(error, dict) else data
    text = raw[:2000].decode("utf-8", "replace")
    message = err.get("message") or err.get("detail") or text or f"HTTP {status}"
    err_type = err.get("type") if isinstance(err.get("type"), str) else None
    return ProxyError(
        status, str(message), param=err.get("param"), code=err.get("code"), err_type=err_type
    )
