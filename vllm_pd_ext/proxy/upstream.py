"""The proxy's HTTP/1.1 client for one engine: pooled keep-alive connections, one error type.

Written on asyncio's protocol/transport layer rather than on a client library because it is
the proxy's hot path: every request is sent here and every streamed event read here. Measured
on the pass-through benchmark (``benchmarks/proxy_overhead.py``), httpx's stack cost ~6.7 ms
of a 9.4 ms first token and an aiohttp session ~0.25 ms of CPU per request, most of it before
the request reached the engine; this client does the same exchange in a fraction of that: one
write per request, the response parsed in place (status line, headers, chunked or
length-delimited body), events handed over as they arrive.

What it speaks is what the engines (uvicorn) answer: HTTP/1.1, ``Content-Length`` or
``chunked`` bodies (or a body closed by the server), no compression asked for, no redirects
followed. The service sees ``Upstream``, ``UpstreamResponse`` and ``UpstreamError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from vllm_pd_ext.util import jsonb
from vllm_pd_ext.util.aio import within

#: Error kinds. ``connect``: refused or unresolvable (the engine is not there);
#: ``connect_timeout``; ``read_timeout``: no byte within the read timeout;
#: ``timeout``: the whole exchange ran past its limit; ``disconnected``: the connection
#: broke, the answer was cut short or was not HTTP.
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


@dataclass(frozen=True)
class Timeouts:
    """Limits for one exchange, in seconds (None = no limit).

    ``total`` bounds the whole exchange including the body; ``read`` bounds each wait for
    bytes (headers, then every chunk); ``connect`` bounds opening a connection.
    """

    total: float | None = None
    connect: float | None = None
    read: float | None = None

    def client(self) -> Timeouts:
        """What ``Upstream.send`` and ``fetch`` take (the limits themselves)."""
        return self


#: Bytes buffered from an engine before reading from it pauses (a slow client).
_HIGH_WATER = 1 << 20
#: Longest response head accepted.
_MAX_HEAD = 64 * 1024
#: What a response head's line that ``_Conn._head`` reads can start with: the first letter
#: of ``content-length``, ``transfer-encoding`` or ``connection`` in either case, or what
#: ``bytes.strip`` takes before a name (an empty line too: ``b"" in`` is true).
_FIELD_STARTS = b"cCtT \t\n\r\x0b\x0c"

# body framing of the response being read
_HEAD, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILER, _UNTIL_EOF, _DONE = range(8)


class _Protocol(Exception):
    """The engine's answer is not HTTP/1.1 as this client reads it."""


class _Conn(asyncio.Protocol):
    """One keep-alive connection to an engine; one exchange at a time.

    ``data_received`` parses in place: the head once, then the body's payload bytes go to
    ``chunks`` (chunk framing removed) and whoever waits is woken. A ``sink`` (see
    ``UpstreamResponse.set_sink``) may take the payload first, as one piece per read (what
    the read's chunks carried, joined); what it takes wakes nobody.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        #: The read timer (``wait``), kept across waits and exchanges until it fires.
        self.timer: asyncio.TimerHandle | None = None
        self._by: float | None = None  # when the current wait times out (loop time)
        self._until: float | None = None  # the current wait's exchange deadline (loop time)
        self._kind: ErrorKind = "read_timeout"
        self._timeout = 0.0
        self.reset()

    def reset(self) -> None:
        """Ready for the next exchange."""
        self.state = _HEAD
        self.buf = b""
        self.status = 0
        self.keep_alive = True
        self.left = 0  # bytes still due: of the Content-Length body, or of the current chunk
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.paused = False
        self.error: BaseException | None = None
        self.got_bytes = False
        self.head_only = False
        self.waiter: asyncio.Future | None = None
        self.sink: Callable[[bytes], bool] | None = None
        #: Becomes ``sink`` when the head says 200 (``Upstream.send(sink_on_ok=...)``).
        self.sink_on_ok: Callable[[bytes], bool] | None = None
        self.rx_at = 0.0  # when the sink last got bytes (loop time)
        #: a chunked request body still being written (``Upstream.send(body_open=True)``)
        self.body_open = False

    # -- asyncio.Protocol --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def _leave(self, piece: bytes) -> None:
        """A read's payload the sink did not take (nothing was left before it): left to
        whoever reads the response, reading paused when it is large."""
        self.chunks.append(piece)
        self.buffered = len(piece)
        transport = self.transport
        if len(piece) > _HIGH_WATER and transport is not None:
            self.paused = True
            transport.pause_reading()

    def data_received(self, data: bytes) -> None:
        sink = self.sink
        if (
            sink is not None
            and self.state == _CHUNK_SIZE
            and not self.buf
            and not self.chunks
            and self.error is None
        ):
            # A streamed read as a rule: one whole chunk, its payload offered to the sink
            end = data.find(b"\r\n")
            if end > 0 and data.endswith(b"\r\n"):
                try:
                    size = int(data[:end], 16)
                except ValueError:  # chunk extensions, or not a chunk
                    size = 0
                if size > 0 and end + size + 4 == len(data):
                    self.rx_at = self.loop.time()
                    piece = data[end + 2 : -2]
                    if sink(piece):
                        return  # taken, the body goes on: nobody to wake
                    self._leave(piece)
                    self._wake()
                    return
            # Else whole chunks only (the body's end among them, or not), their payload
            # offered to the sink in one piece, without the general parse below (which
            # takes anything else, nothing read here)
            pieces: list[bytes] = []
            pos, n, done = 0, len(data), False
            while pos < n:
                end = data.find(b"\r\n", pos)
                if end <= pos:
                    break
                try:
                    size = int(data[pos:end], 16)
                except ValueError:  # chunk extensions, or not a chunk
                    break
                stop = end + 2 + size
                if size <= 0:  # the last chunk, without a trailer: the body is complete
                    done = size == 0 and stop + 2 == n and data[stop:] == b"\r\n"
                    break
                if data[stop : stop + 2] != b"\r\n":
                    break  # a chunk that continues in a later read
                pieces.append(data[end + 2 : stop])
                pos = stop + 2
            if pos == n or done:
                if done:
                    self.state = _DONE
                self.rx_at = self.loop.time()
                if pieces:
                    piece = pieces[0] if len(pieces) == 1 else b"".join(pieces)
                    if sink(piece):
                        if not done:
                            return  # taken, the body goes on: nobody to wake
                    else:
                        self._leave(piece)
                self._wake()
                return
        self.got_bytes = True  # (a sink is set after a head: bytes were read before)
        if self.state == _DONE or self.error is not None:
            self.keep_alive = False  # bytes nobody asked for: never reuse this connection
            return
        chunks = self.chunks
        left = len(chunks)  # pieces the waiting task has not taken yet
        try:
            self._parse(self.buf + data if self.buf else data)
        except (_Protocol, ValueError, IndexError) as exc:
            self.error = _Protocol(f"malformed response: {exc}")
            self.keep_alive = False
            if self.transport is not None:
                self.transport.close()
        sink = self.sink  # (a head parsed just now may have installed it)
        if sink is not None:
            self.rx_at = self.loop.time()
            if not left and chunks:  # nothing left before: this read's payload, offered whole
                piece = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                if sink(piece):
                    chunks.clear()
                    self.buffered = 0
        if self.buffered > _HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        if (
            sink is not None
            and not chunks
            and self.state not in (_HEAD, _DONE)
            and self.error is None
        ):
            # The sink took it all (a head that installed it included): nothing for the
            # waiting task, which wakes for what the sink leaves, the end or an error.
            return
        self._wake()

    def eof_received(self) -> bool:
        return False  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.timer is not None and self.waiter is None:
            self.timer.cancel()  # no wait to time out: nothing keeps this connection
            self.timer = None
        if self.state == _UNTIL_EOF:
            self.state = _DONE  # a body delimited by the server closing: complete
        elif self.state != _DONE and self.error is None:
            self.error = exc or ConnectionResetError("the engine closed the connection")
        self._wake()

    # -- parsing -----------------------------------------------------------------------

    def _parse(self, data: bytes) -> None:
        while data:
            state = self.state
            if state == _CHUNK_SIZE:
                end = data.find(b"\r\n")
                if end < 0:
                    if len(data) > 4096:
                        raise _Protocol("chunk size line too long")
                    break
                size = int(data[:end].split(b";", 1)[0], 16)
                start = end + 2
                if not size:
                    data = data[start:]
                    self.state = _TRAILER
                elif data[start + size : start + size + 2] == b"\r\n":
                    # the whole chunk is here (a streamed event, as a rule): taken at once
                    self._payload(data[start : start + size])
                    data = data[start + size + 2 :]
                else:
                    data = data[start:]
                    self.left, self.state = size, _CHUNK_DATA
            elif state == _CHUNK_DATA:
                n = self.left
                if len(data) >= n:
                    self._payload(data[:n])
                    data = data[n:]
                    self.state = _CHUNK_END
                else:
                    self._payload(data)
                    self.left -= len(data)
                    data = b""
            elif state == _CHUNK_END:
                if len(data) < 2:
                    break
                if data[:2] != b"\r\n":
                    raise _Protocol("chunk not followed by CRLF")
                data = data[2:]
                self.state = _CHUNK_SIZE
            elif state == _LENGTH:
                n = self.left
                if len(data) >= n:
                    self._payload(data[:n])
                    data = data[n:]
                    self.state = _DONE
                else:
                    self._payload(data)
                    self.left -= len(data)
                    data = b""
            elif state == _UNTIL_EOF:
                self._payload(data)
                data = b""
            elif state == _HEAD:
                end = data.find(b"\r\n\r\n")
                if end < 0:
                    if len(data) > _MAX_HEAD:
                        raise _Protocol("response head too long")
                    break
                head, data = data[:end], data[end + 4 :]
                self._head(head)
            elif state == _TRAILER:
                if data[:2] == b"\r\n":
                    data = data[2:]
                    self.state = _DONE
                else:
                    end = data.find(b"\r\n\r\n")
                    if end < 0:
                        break
                    data = data[end + 4 :]
                    self.state = _DONE
            else:  # _DONE with bytes left over: not ours to read
                self.keep_alive = False
                data = b""
        self.buf = data

    def _payload(self, data: bytes) -> None:
        if data:
            self.chunks.append(data)
            self.buffered += len(data)

    def _head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        version, _, rest = lines[0].partition(b" ")
        if not version.startswith(b"HTTP/1."):
            raise _Protocol(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        status = int(rest[:3])
        if 100 <= status < 200:
            return  # an interim answer: the real head follows
        length: int | None = None
        chunked = False
        keep_alive = version == b"HTTP/1.1"
        for line in lines[1:]:
            if line[:1] not in _FIELD_STARTS:
                continue  # none of the fields read below (most of a head: date, server, ...)
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
                if length < 0:
                    raise _Protocol("negative Content-Length")
            elif name == b"transfer-encoding":
                chunked = value.strip().lower().endswith(b"chunked")
            elif name == b"connection":
                tokens = value.lower()
                if b"close" in tokens:
                    keep_alive = False
                elif b"keep-alive" in tokens:
                    keep_alive = True
        self.status = status
        self.keep_alive = keep_alive
        if status == 200 and self.sink_on_ok is not None:
            self.sink, self.rx_at = self.sink_on_ok, self.loop.time()
        self.sink_on_ok = None
        if self.head_only or status in (204, 304):
            self.state = _DONE
        elif chunked:
            self.state = _CHUNK_SIZE
        elif length is not None:
            self.left = length
            self.state = _LENGTH if length else _DONE
        else:
            self.state = _UNTIL_EOF
            self.keep_alive = False

    # -- waiting -----------------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def take(self) -> bytes:
        """Everything buffered so far, as one bytes object."""
        chunks = self.chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self.buffered = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    async def wait(self, read_s: float | None, deadline: float | None) -> None:
        """Wait for the next bytes (or the end); raises ``UpstreamError`` on a timeout.

        One timer per connection, not one per wait: a wait sets its limit (``_by``) and
        arms the timer only when none is due by then; a timer that fires early finds the
        limit later (a later wait's, or pushed by bytes the sink took, never past
        ``deadline``) and re-arms for it.
        """
        loop = self.loop
        timeout, kind = read_s, "read_timeout"
        if deadline is not None:
            left = deadline - loop.time()
            if timeout is None or left < timeout:
                timeout, kind = max(left, 0.0), "timeout"
        waiter = self.waiter = loop.create_future()
        if timeout is not None:
            by = loop.time() + timeout
            self._by, self._kind, self._timeout = by, kind, timeout
            self._until = deadline
            timer = self.timer
            if timer is None or timer.when() > by:
                if timer is not None:
                    timer.cancel()
                self.timer = loop.call_at(by, self._expire)
        try:
            expired: ErrorKind | None = await waiter
        finally:
            self.waiter = None
            self._by = None  # the timer stays, for the next wait
        if expired == kind:
            raise UpstreamError(kind, f"no answer within {timeout:.3g} s")
        if expired is not None:  # the sink kept the read going until the deadline
            raise UpstreamError(expired, "the exchange ran past its total limit")

    def _expire(self) -> None:
        self.timer = None
        waiter, by = self.waiter, self._by
        if waiter is None or by is None or waiter.done():
            return  # no wait now: the next one arms a timer
        if self._kind == "read_timeout" and self.sink is not None:
            # bytes the sink took count as read: the limit runs from the last of them, up
            # to the exchange's deadline
            by = max(by, self.rx_at + self._timeout)
            until = self._until
            if until is not None and by >= until:
                by, self._kind = until, "timeout"
            self._by = by
        if self.loop.time() < by:
            self.timer = self.loop.call_at(by, self._expire)
            return
        waiter.set_result(self._kind)

    def close(self) -> None:
        self.closed = True
        self.sink = None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.transport is not None:
            self.transport.close()


def json_object(raw: bytes) -> dict[str, Any] | None:
    """An answer's body as the JSON object it should be; None when it is not one."""
    try:
        data = jsonb.loads(raw)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def _disconnected(exc: BaseException) -> UpstreamError:
    if isinstance(exc, UpstreamError):
        return exc
    detail = str(exc) or type(exc).__name__
    return UpstreamError("disconnected", f"{type(exc).__name__}: {detail}")


class UpstreamResponse:
    """An engine's answer whose body has not been read yet. Close it exactly once."""

    __slots__ = ("_conn", "_deadline", "_pool", "_read_s", "status")

    def write(self, data: bytes) -> None:
        """One more piece of a request body sent with ``body_open`` (a chunk of it)."""
        conn = self._conn
        if data and conn.body_open and conn.transport is not None:
            conn.transport.write(b"%x\r\n%b\r\n" % (len(data), data))

    def end_body(self) -> None:
        """End a request body sent with ``body_open``."""
        conn = self._conn
        if conn.body_open and conn.transport is not None:
            conn.body_open = False
            conn.transport.write(b"0\r\n\r\n")

    def __init__(self, pool: Upstream, conn: _Conn, read_s: float | None, deadline: float | None):
        self._pool = pool
        self._conn = conn
        self._read_s = read_s
        self._deadline = deadline
        self.status = conn.status

    async def read(self) -> bytes:
        """The whole body. Raises ``UpstreamError``."""
        conn = self._conn
        parts: list[bytes] = []
        while True:
            if conn.chunks:
                parts.append(conn.take())
            if conn.state == _DONE:
                return b"".join(parts)
            if conn.error is not None:
                raise _disconnected(conn.error)
            await conn.wait(self._read_s, self._deadline)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives (what arrived together in one piece). Raises
        ``UpstreamError`` if it is cut short, after the bytes that came before the break."""
        conn = self._conn
        read_s, deadline = self._read_s, self._deadline
        while True:
            if conn.chunks:
                yield conn.take()
            elif conn.state == _DONE:
                return
            elif conn.error is not None:
                raise _disconnected(conn.error)
            else:
                await conn.wait(read_s, deadline)

    @property
    def has_body_bytes(self) -> bool:
        """Are body bytes waiting to be read (none read or sunk yet)?"""
        return bool(self._conn.chunks)

    async def arrived(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the body's first bytes (or its end, or an
        error, which ``read``/``chunks`` then raise): True when any came. Call it before a
        sink is set (bytes a sink takes wake nobody)."""
        conn = self._conn
        deadline = conn.loop.time() + timeout
        while not conn.chunks and conn.state != _DONE and conn.error is None:
            left = deadline - conn.loop.time()
            if left <= 0:
                return False
            try:
                await conn.wait(left, None)
            except UpstreamError:
                return False
        return True

    def set_sink(self, sink: Callable[[bytes], bool] | None) -> None:
        """Offer the body to ``sink`` as it arrives, before ``chunks`` sees it: one piece per
        read from the connection (the payload of every chunk that read completed, joined).

        ``sink(piece)`` returns True when it took the piece (``chunks`` never yields it), False
        to leave it to ``chunks``; once a piece is left there, later ones are too until
        ``chunks`` has yielded them (order kept). It runs inside the connection's
        ``data_received``, so it must not raise. Pieces it takes count as read for the read
        timeout. The end of the body, an error and pieces left over still reach ``chunks``.
        """
        conn = self._conn
        conn.sink = sink
        conn.rx_at = conn.loop.time()

    def close(self) -> None:
        """Give the connection back to the pool if the body was read to its end; otherwise
        close it, so the engine sees the disconnect and aborts the request."""
        conn, self._conn = self._conn, None  # type: ignore[assignment]
        if conn is None:
            return
        conn.sink = None
        done = conn.state == _DONE and not conn.chunks and not conn.body_open
        if done and conn.keep_alive and not conn.closed:
            self._pool._release(conn)
        else:
            conn.close()


async def discard(task: asyncio.Future[UpstreamResponse]) -> None:
    """Cancel a pending upstream request, closing its response if it already arrived. A
    cancellation of the caller itself still propagates."""
    task.cancel()
    try:
        await asyncio.wait((task,))
    finally:
        if task.done() and not task.cancelled() and task.exception() is None:
            task.result().close()


class Upstream:
    """One engine's base URL and its pooled keep-alive connections.

    Idle connections are dropped after ``keepalive_s``, under the engines' own keep-alive
    (uvicorn's and vLLM's default is 5 s), so a pooled connection is not reused just as the
    engine closes it; a reused connection that the engine closed anyway before answering a
    byte is retried once on a fresh one. ``max_connections`` bounds the idle pool (the
    admission limit bounds the busy ones). Create and close it on the proxy's event loop.
    """

    def __init__(self, base_url: str, *, max_connections: int, keepalive_s: float = 4.0):
        self.base_url = base_url
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._ssl: ssl.SSLContext | None = (
            ssl.create_default_context() if parts.scheme == "https" else None
        )
        self._prefix = parts.path.rstrip("/")
        host_header = parts.netloc.rpartition("@")[2]
        self._head_tail = f" HTTP/1.1\r\nHost: {host_header}\r\n".encode("latin-1")
        self._idle: list[_Conn] = []
        self._loop: asyncio.AbstractEventLoop | None = None  # the one it was last used on
        self._max_idle = max(1, max_connections)
        self._keepalive_s = keepalive_s
        self._closed = False

    # -- connections -------------------------------------------------------------------

    def _release(self, conn: _Conn) -> None:
        if self._closed or len(self._idle) >= self._max_idle:
            conn.close()
            return
        conn.reset()
        conn.idle_since = conn.loop.time()
        self._idle.append(conn)

    def _pooled(self, loop: asyncio.AbstractEventLoop) -> _Conn | None:
        idle = self._idle
        while idle:
            conn = idle.pop()
            if not conn.closed and loop.time() - conn.idle_since < self._keepalive_s:
                return conn
            conn.close()
        return None

    async def _connect(self, loop: asyncio.AbstractEventLoop, connect_s: float | None) -> _Conn:
        opening = loop.create_connection(
            lambda: _Conn(loop),
            self._host,
            self._port,
            ssl=self._ssl,
            server_hostname=self._host if self._ssl else None,
        )
        try:
            _, conn = await within(opening, connect_s, lambda pair: pair[0].close())
        except asyncio.TimeoutError:
            raise UpstreamError("connect_timeout", f"{self.base_url}: no connection") from None
        except OSError as exc:
            raise UpstreamError("connect", f"{self.base_url}: {exc}") from None
        return conn

    # -- exchanges ---------------------------------------------------------------------

    def _request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | bytes | None,
        headers: dict[str, str] | None,
        body_open: bool = False,
    ) -> bytes:
        head = method + " " + self._prefix + path
        lines = ""
        if headers:
            for name, value in headers.items():
                if "\r" in value or "\n" in value:
                    raise ValueError(f"header {name} holds a line break")
                lines += f"{name}: {value}\r\n"
        if body is None:
            if method in ("POST", "PUT", "PATCH"):
                lines += "Content-Length: 0\r\n"
            return head.encode("latin-1") + self._head_tail + lines.encode("latin-1") + b"\r\n"
        data = body if isinstance(body, bytes) else json.dumps(body, separators=(",", ":")).encode()
        if body_open:
            lines += "Transfer-Encoding: chunked\r\n\r\n"
            data = b"%x\r\n%b\r\n" % (len(data), data) if data else b""
            return head.encode("latin-1") + self._head_tail + lines.encode("latin-1") + data
        lines += f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
        return head.encode("latin-1") + self._head_tail + lines.encode("latin-1") + data

    async def send(
        self,
        method: str,
        path: str,
        timeouts: Timeouts,
        body: dict[str, Any] | bytes | None = None,
        headers: dict[str, str] | None = None,
        sink_on_ok: Callable[[bytes], bool] | None = None,
        body_open: bool = False,
    ) -> UpstreamResponse:
        """Send one request; return once the head is in, the body unread. ``body``: an
        object sent as JSON, or JSON already encoded. ``sink_on_ok``: when the head says 200,
        the response's sink from then on (``UpstreamResponse.set_sink``): the body's bytes
        go to it as they come, and this returns only once the sink leaves some, the body
        ends or the connection fails (a stream the sink takes whole needs no task woken).

        ``body_open``: ``body`` (bytes; its ``Content-Type`` in ``headers``) is the first
        piece of a chunked body that the response's ``write`` continues and ``end_body`` ends,
        while the answer is read (a full-duplex exchange); the connection is reused only if
        the body was ended.

        ``timeouts`` comes from ``Timeouts.client()``. Raises ``UpstreamError``. Cancelling
        the caller closes the connection.
        """
        if self._closed:
            raise UpstreamError("disconnected", f"{self.base_url}: client closed")
        payload = self._request(method, path, body, headers, body_open)
        loop = self._loop  # (asyncio's get_running_loop costs a getpid() call on 3.11)
        if loop is None or not loop.is_running():
            loop = self._loop = asyncio.get_running_loop()
        deadline = None if timeouts.total is None else loop.time() + timeouts.total
        read_s = timeouts.read
        conn = self._pooled(loop)
        reused = conn is not None
        if conn is None:
            connect_s = timeouts.connect
            if deadline is not None:
                connect_s = min(connect_s or timeouts.total, timeouts.total)  # type: ignore[type-var]
            conn = await self._connect(loop, connect_s)
        try:
            while True:
                conn.head_only = method == "HEAD"
                conn.sink_on_ok = sink_on_ok
                conn.body_open = body_open
                conn.transport.write(payload)  # type: ignore[union-attr]
                while conn.state == _HEAD:
                    if conn.error is not None:
                        break
                    try:
                        await conn.wait(read_s, deadline)
                    except UpstreamError as exc:
                        if conn.state == _HEAD:
                            raise
                        # The head is in and the sink took the body since: whoever reads
                        # the response meets the timeout, after what came before it.
                        conn.error = exc
                if conn.state != _HEAD:
                    return UpstreamResponse(self, conn, read_s, deadline)
                if reused and not conn.got_bytes and not isinstance(conn.error, _Protocol):
                    # the engine closed an idle pooled connection as we used it: once more
                    # on a fresh one (it never saw the request)
                    conn.close()
                    reused = False
                    conn = await self._connect(loop, timeouts.connect)
                    continue
                raise _disconnected(conn.error)  # type: ignore[arg-type]
        except BaseException:
            conn.close()
            raise

    async def fetch(
        self,
        method: str,
        path: str,
        timeouts: Timeouts,
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
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
        with contextlib.suppress(Exception):
            await asyncio.sleep(0)  # let the transports finish closing
