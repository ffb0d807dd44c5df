"""The proxy's HTTP client for one engine: a pooled aiohttp session and one error type.

aiohttp rather than httpx because the client is the proxy's hot path: measured here, httpx's
stack (httpcore, anyio, h11) cost ~6.7 ms of a 9.4 ms pass-through first token, an aiohttp
session about a tenth of that (``benchmarks/proxy_overhead.py``). Everything aiohttp-specific
stays in this module: the service sees ``Upstream``, ``UpstreamResponse`` and
``UpstreamError``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp

#: Error kinds. ``connect``: refused or unresolvable (the engine is not there);
#: ``connect_timeout``; ``read_timeout``: no byte within the read timeout;
#: ``timeout``: the whole exchange ran past its limit; ``disconnected``: the connection
#: broke or the answer was cut short.
ErrorKind = str


class UpstreamError(Exception):
    """An exchange with an engine failed below HTTP (no usable status, or a cut answer).

    ``kind`` is one of the kinds above; ``down`` is True when the failure says the engine
    itself is gone or broken (take it out of rotation), False for a read or total timeout,
    which a busy engine can cause.
    """

    def __init__(self, kind: ErrorKind, detail: str):
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind

    @property
    def down(self) -> bool:
        return self.kind in ("connect", "connect_timeout", "disconnected")


def _map(exc: BaseException) -> UpstreamError:
    """One aiohttp or socket exception as an ``UpstreamError``."""
    detail = str(exc) or type(exc).__name__
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return UpstreamError("connect_timeout", detail)
    if isinstance(exc, aiohttp.SocketTimeoutError):
        return UpstreamError("read_timeout", detail)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return UpstreamError("connect", detail)
    if isinstance(exc, asyncio.TimeoutError):
        return UpstreamError("timeout", detail)
    return UpstreamError("disconnected", f"{type(exc).__name__}: {detail}")


#: What ``_map`` turns into ``UpstreamError``.
_CLIENT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


@dataclass(frozen=True)
class Timeouts:
    """Limits for one exchange, in seconds (None = no limit).

    ``total`` bounds the whole exchange including the body; ``read`` bounds each wait for
    bytes (headers, then every chunk); ``connect`` bounds opening a connection.
    """

    total: float | None = None
    connect: float | None = None
    read: float | None = None

    def client(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(
            total=self.total, sock_connect=self.connect, sock_read=self.read
        )


def _buffered(content: aiohttp.StreamReader) -> bytes:
    """Bytes received before the connection broke and not yet read.

    aiohttp's readers raise a broken connection's error before returning what is buffered;
    the last events an engine sent before dying belong to the client, so take them from the
    buffer (private API, guarded: an aiohttp without it loses them, as before).
    """
    try:
        return content._read_nowait(-1) if getattr(content, "_buffer", None) else b""
    except Exception:
        return b""


class UpstreamResponse:
    """An engine's answer whose body has not been read yet. Close it exactly once."""

    __slots__ = ("_resp", "status")

    def __init__(self, resp: aiohttp.ClientResponse):
        self._resp = resp
        self.status = resp.status

    async def read(self) -> bytes:
        """The whole body. Raises ``UpstreamError``."""
        try:
            return await self._resp.read()
        except _CLIENT_ERRORS as exc:
            raise _map(exc) from None

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives. Raises ``UpstreamError`` if it is cut short."""
        content = self._resp.content
        try:
            while True:
                chunk = await content.readany()
                if not chunk:
                    return
                yield chunk
        except _CLIENT_ERRORS as exc:
            error = _map(exc)
        rest = _buffered(content)  # events that arrived just before the connection broke
        if rest:
            yield rest
        raise error

    def close(self) -> None:
        """Give the connection back to the pool if the body was read to its end; otherwise
        close it, so the engine sees the disconnect and aborts the request."""
        if self._resp.content.at_eof():
            self._resp.release()
        else:
            self._resp.close()


class Upstream:
    """One engine's base URL and its pooled connections (one aiohttp session).

    Idle connections are dropped after ``keepalive_s``, under the engines' own keep-alive
    (uvicorn's and vLLM's default is 5 s), so a pooled connection is not reused just as the
    engine closes it. Create and close it on the proxy's event loop.
    """

    def __init__(self, base_url: str, *, max_connections: int, keepalive_s: float = 4.0):
        self.base_url = base_url
        connector = aiohttp.TCPConnector(
            limit=max_connections, keepalive_timeout=keepalive_s, ttl_dns_cache=60
        )
        self._session = aiohttp.ClientSession(
            base_url=base_url,
            connector=connector,
            cookie_jar=aiohttp.DummyCookieJar(),
            # The relay forwards bytes as the engine sent them: ask for no compression.
            skip_auto_headers=("Accept-Encoding", "User-Agent"),
            trust_env=False,
        )

    async def send(
        self,
        method: str,
        path: str,
        timeouts: aiohttp.ClientTimeout,
        body: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> UpstreamResponse:
        """Send one request; return once the headers are in, the body unread.

        ``timeouts`` comes from ``Timeouts.client()``. Raises ``UpstreamError``. Cancelling
        the caller closes the connection.
        """
        hdrs = dict(headers) if headers else {}
        data = None
        if body is not None:
            data = json.dumps(body, separators=(",", ":")).encode()
            hdrs["Content-Type"] = "application/json"
        try:
            resp = await self._session.request(
                method, path, data=data, headers=hdrs, timeout=timeouts, allow_redirects=False
            )
        except _CLIENT_ERRORS as exc:
            raise _map(exc) from None
        return UpstreamResponse(resp)

    async def fetch(
        self,
        method: str,
        path: str,
        timeouts: aiohttp.ClientTimeout,
        body: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, bytes]:
        """Send one request and read its whole body: ``(status, body)``.

        Raises ``UpstreamError``; cancelling the caller closes the connection.
        """
        resp = await self.send(method, path, timeouts, body, headers)
        try:
            return resp.status, await resp.read()
        finally:
            resp.close()

    async def close(self) -> None:
        await self._session.close()
