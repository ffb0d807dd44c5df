"""Bearer-token checks on plain ASGI scopes (the proxy's and the render server's front doors)."""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from typing import Any


def bearer_ok(scope: Mapping[str, Any], secret: str) -> bool:
    """Whether the request's ``Authorization`` header is ``Bearer <secret>`` (compared in
    constant time)."""
    header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
    scheme, _, token = header.decode("latin-1").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), secret.encode())
