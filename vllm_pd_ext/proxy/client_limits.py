"""What a client may make the proxy wait for or hold, on public interfaces only.

The fast path (``front_protocol.py``) enforces these inside its own request cycle. This module
gives the plain path (``fast_path: false``, or a uvicorn without the internals the fast path
reads) the same guarantees on the ASGI and asyncio interfaces alone:

- ``BodyBudget``: the bytes of request bodies held at once, over all connections of one
  process (shared with the fast path when that is on).
- ``BodyReader``: a completion request's body read through ASGI ``receive``, within the body
  timeout (408), ``max_body_bytes`` (413) and the budget (503); each answer closes the
  connection, and the budget gets back what it gave on every path.
- ``read_deadlines``: an ``asyncio.Protocol`` wrapper around uvicorn's HTTP protocol class
  that closes a connection whose request head has not arrived within the head timeout, or
  whose body has not arrived within the body timeout (plus a grace that lets the app answer
  408 first), for every route. uvicorn's public settings have neither (``timeout_keep_alive``
  covers only idle keep-alive connections).
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

from vllm_pd_ext.proxy.errors import ProxyError

logger = logging.getLogger(__name__)

#: The 503 answer's message when a body would pass the budget (both paths).
BUSY_MESSAGE = "the proxy holds too many request bodies at once; retry later"


class BodyBudget:
    """Bytes of request bodies the proxy holds at once, over all connections of one process
    (the event loop's thread only: no lock). A request whose body would pass it is answered
    503 and nothing of it is kept: ``max_connections`` clients each sending
    ``max_body_bytes`` cannot make the proxy hold more than ``limit``."""

    __slots__ = ("limit", "used")

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0

    def take(self, n: int) -> bool:
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used -= n


# -- the body, through ASGI ---------------------------------------------------------------------


class BodyHold:
    """A request body read in full, counted against the budget until ``release()`` (once;
    also on leaving a ``with`` block). ``take_body()`` hands the body over; ``receive`` is
    the ASGI ``receive`` to hand the app: the body (unless taken), then the server's own
    channel (a disconnect)."""

    __slots__ = ("_budget", "_chunks", "_receive", "held")

    def __init__(self, budget: BodyBudget, receive: Any) -> None:
        self._budget, self._receive = budget, receive
        self._chunks: list[bytes] | None = []
        self.held = 0

    def _add(self, chunk: bytes) -> None:
        assert self._chunks is not None
        self._chunks.append(chunk)
        self.held += len(chunk)

    def take_body(self) -> bytes:
        """The body, once (empty after); ``receive`` hands it out the same way."""
        chunks, self._chunks = self._chunks, None
        if not chunks:
            return b""
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def receive(self) -> dict:
        if self._chunks is None:
            return await self._receive()
        return {"type": "http.request", "body": self.take_body(), "more_body": False}

    def release(self) -> None:
        self._budget.give(self.held)
        self.held = 0
        self._chunks = None

    def __enter__(self) -> BodyHold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def body_timeout_error(timeout_s: float) -> ProxyError:
    """The 408 for a body that did not arrive within ``timeout_s`` of its head (both paths)."""
    return ProxyError(408, f"request body not received within {timeout_s:g} s", code="body_timeout")


def _declared_length(scope: dict) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


class BodyReader:
    """Reads a request body through ASGI ``receive`` within the proxy's limits: in full
    within ``timeout_s`` of the call (the app is called once the head is in), at most
    ``max_bytes``, and within the process's ``budget``. Runs on the event loop."""

    def __init__(self, max_bytes: int, timeout_s: float, budget: BodyBudget) -> None:
        self.max_bytes, self.timeout_s, self.budget = max_bytes, timeout_s, budget

    async def read(self, scope: dict, receive: Any) -> BodyHold | None:
        """The body, held (the caller releases it); None when the client went away first.
        Raises ``ProxyError`` 408 (too slow), 413 (too large) or 503 (over the budget);
        nothing is held then, and the answer should close the connection."""
        declared = _declared_length(scope)
        if declared is not None and declared > self.max_bytes:
            raise self._too_large()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        hold = BodyHold(self.budget, receive)
        try:
            while True:
                try:
                    message = await asyncio.wait_for(receive(), deadline - loop.time())
                except asyncio.TimeoutError:
                    raise body_timeout_error(self.timeout_s) from None
                if message["type"] != "http.request":
                    hold.release()
                    return None
                chunk = message.get("body", b"")
                if chunk:
                    if hold.held + len(chunk) > self.max_bytes:
                        raise self._too_large()
                    if not self.budget.take(len(chunk)):
                        logger.warning(
                            "answered 503: request bodies held at once would pass %d bytes",
                            self.budget.limit,
                        )
                        raise ProxyError(503, BUSY_MESSAGE, code="body_budget")
                    hold._add(chunk)
                if not message.get("more_body", False):
                    return hold
        except BaseException:
            hold.release()
            raise

    def _too_large(self) -> ProxyError:
        message = f"request body exceeds {self.max_bytes} bytes"
        return ProxyError(413, message, code="body_too_large")


# -- the head (and body), at the connection ---------------------------------------------------

#: A request head (or a chunked body's trailers, or one chunk-size line) longer than this
#: closes the connection.
MAX_HEAD_BYTES = 64 * 1024
#: The connection's own body deadline runs this much past the body timeout, so that on the
#: completion routes the app's 408 goes out before the connection is closed.
BODY_GRACE_S = 1.0

#: How often a deadline that passed while the server had paused reading looks again.
PAUSED_POLL_S = 0.5

_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")

# phases of ``_Framing``
_IDLE, _HEAD, _FIXED, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILER = range(7)


class _Framing:
    """Where one connection's stream of HTTP/1.1 requests stands: between requests, in a
    head, or in a body (``Content-Length`` or chunked, RFC 9112 section 6). It reads only
    what framing needs; the server's own parser still parses everything. ``feed`` says
    False when the stream cannot be framed (the server's parser refuses such a request)."""

    __slots__ = ("_chunked", "_cl", "_left", "_line", "_size", "_started", "phase", "requests")

    def __init__(self) -> None:
        self.phase = _IDLE
        self.requests = 0  # heads begun
        self._line = b""  # the line being read (head, chunk size, trailers)
        self._size = 0  # bytes of the current head or trailer block
        self._left = 0  # bytes left of a fixed body or a chunk
        self._started = False  # the head's request line has been read
        self._cl: int | None = None
        self._chunked = False

    @property
    def stage(self) -> str:
        """``idle``, ``head`` or ``body``."""
        phase = self.phase
        return "idle" if phase == _IDLE else "head" if phase == _HEAD else "body"

    def feed(self, data: bytes) -> bool:
        i, n = 0, len(data)
        while i < n:
            phase = self.phase
            if phase == _IDLE:
                self.phase, self.requests = _HEAD, self.requests + 1
                self._size, self._started, self._cl, self._chunked = 0, False, None, False
            elif phase in (_FIXED, _CHUNK_DATA):
                take = min(self._left, n - i)
                self._left -= take
                i += take
                if self._left == 0:
                    self.phase = _IDLE if phase == _FIXED else _CHUNK_END
            else:  # a line-oriented phase
                end = data.find(b"\n", i)
                if end < 0:
                    self._line += data[i:]
                    if len(self._line) > MAX_HEAD_BYTES:
                        return False
                    i = n
                    continue
                line, self._line = self._line + data[i:end], b""
                i = end + 1
                self._size += len(line) + 1
                if self._size > MAX_HEAD_BYTES or not self._on_line(line.rstrip(b"\r")):
                    return False
        return True

    def _on_line(self, line: bytes) -> bool:
        phase = self.phase
        if phase == _HEAD:
            if not self._started:  # empty lines before the request line are ignored
                self._started = line != b""
                return True
            if line:
                return self._header(line)
            if self._chunked:
                self.phase = _CHUNK_SIZE
            elif self._cl:
                self.phase, self._left = _FIXED, self._cl
            else:
                self.phase = _IDLE
            return True
        if phase == _CHUNK_SIZE:
            size = line.partition(b";")[0].strip()
            if not _HEX.fullmatch(size):
                return False
            self._left = int(size, 16)
            if self._left:
                self.phase = _CHUNK_DATA
            else:
                self.phase, self._size = _TRAILER, 0
            return True
        if phase == _CHUNK_END:
            self.phase = _CHUNK_SIZE
            return line == b""
        # _TRAILER: lines until an empty one
        if not line:
            self.phase = _IDLE
        return True

    def _header(self, line: bytes) -> bool:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            value = value.strip()
            if not value.isdigit() or len(value) > 18:
                return False
            if self._cl is not None and self._cl != int(value):
                return False
            self._cl = int(value)
        elif name == b"transfer-encoding":
            # a request's last coding must be chunked (anything else is refused as a 400)
            if value.rpartition(b",")[2].strip().lower() != b"chunked":
                return False
            self._chunked = True
        return True


class ReadDeadlines(asyncio.Protocol):
    """Wraps one connection's HTTP protocol (the class ``read_deadlines`` makes names it):
    every event is passed on unchanged, and the connection is closed when

    - a request head (up to its empty line) has not arrived within ``head_s`` of the
      connection's start, or of the first byte of each later request, pipelined or on a
      kept-alive connection;
    - a request body has not arrived within ``body_s + BODY_GRACE_S`` of its head's end;
    - a head is longer than ``MAX_HEAD_BYTES`` or the stream cannot be framed.

    Between requests nothing runs here: the server's ``timeout_keep_alive`` closes idle
    connections. A deadline that passes while the server itself has paused reading the
    connection (it does while it answers a request before reading the next one) waits until
    it reads again, then runs a whole period more: bytes nobody reads are not the client's
    fault.
    """

    inner_class: type[asyncio.Protocol]
    head_s: float
    body_s: float

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # uvicorn makes it as it makes its own: (config, server_state, app_state, _loop)
        self.inner = self.inner_class(*args, **kwargs)
        self.transport: asyncio.Transport | None = None
        self._framing = _Framing()
        self._timer: asyncio.TimerHandle | None = None

    # -- deadlines

    def _arm(self, stage: str) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if stage != "idle":
            seconds = self.head_s if stage == "head" else self.body_s + BODY_GRACE_S
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(seconds, self._expired, seconds)

    def _expired(self, seconds: float, paused: bool = False) -> None:
        self._timer = None
        transport = self.transport
        if transport is None or transport.is_closing() or transport.get_protocol() is not self:
            return  # gone, or handed to another protocol (an upgrade)
        loop = asyncio.get_running_loop()
        if not transport.is_reading():  # paused by the server: not the client's fault
            poll = min(seconds, PAUSED_POLL_S)
            self._timer = loop.call_later(poll, self._expired, seconds, True)
        elif paused:  # reading again: the client gets a whole period from now
            self._timer = loop.call_later(seconds, self._expired, seconds)
        else:
            logger.debug("closed a client connection that sent its request too slowly")
            transport.close()

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport
        self.inner.connection_made(transport)
        self._arm("head")

    def data_received(self, data: bytes) -> None:
        framing = self._framing
        before = framing.stage, framing.requests  # a chunk ends no stage: no new deadline
        ok = framing.feed(data)
        self.inner.data_received(data)
        if not ok:
            logger.debug("closed a client connection whose request could not be framed")
            self._arm("idle")
            if self.transport is not None:
                self.transport.close()
        elif (framing.stage, framing.requests) != before:
            self._arm(framing.stage)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._arm("idle")
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


_CLASSES: dict[tuple[type, float, float], type[ReadDeadlines]] = {}


def read_deadlines(inner: type[asyncio.Protocol], head_s: float, body_s: float) -> type:
    """A protocol class for uvicorn's ``http`` setting: ``inner`` (uvicorn's HTTP protocol
    class) wrapped in ``ReadDeadlines`` with these timeouts. One class per settings."""
    key = (inner, head_s, body_s)
    cls = _CLASSES.get(key)
    if cls is None:
        attrs = {"inner_class": inner, "head_s": head_s, "body_s": body_s}
        cls = _CLASSES[key] = type(f"ReadDeadlines[{inner.__name__}]", (ReadDeadlines,), attrs)
    return cls


def plain_protocol(head_s: float, body_s: float) -> type | str:
    """uvicorn's ``http`` setting for the plain path: its default protocol (httptools when
    installed, else h11) within ``read_deadlines``; ``"auto"`` (no read deadlines, after a
    WARNING) if uvicorn's ``uvicorn.protocols.http.auto`` module is not where it was."""
    try:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol
    except ImportError as exc:
        logger.warning(
            "no header or body read timeouts on client connections: %s (serving with "
            "uvicorn's default protocol as it is)",
            exc,
        )
        return "auto"
    return read_deadlines(AutoHTTPProtocol, head_s, body_s)
