"""The proxy's HTTP/1.1 server protocol: uvicorn's httptools protocol with a lean request
cycle for the two completion routes.

Measured on the proxy's pass-through path, uvicorn spent ~100 us of a request's time to first
token before our app saw it (the ASGI scope, its request cycle object, the task wrapper, the
body handed over through an event) and checked every header of every response it wrote.
``FastCycle`` serves a complete ``POST /v1/completions`` or ``/v1/chat/completions`` instead:
the body is collected as the parser delivers it, the app runs once it is complete, and its
ASGI messages are written straight to the socket (the head with the first body part).
Everything else (other routes, pipelined requests behind a busy one, ``Expect:
100-continue``, HTTP/1.0, upgrades, a declared body over the limit) takes uvicorn's own
path, unchanged. Both tell a request's ``DisconnectWatch`` when its client goes
(``connection_lost``), and both hold a response head until the first body part
(``_HeadWithBody``).

This subclasses uvicorn internals: ``front_protocol()`` returns None (uvicorn's default
protocol then) when the installed uvicorn lacks what it overrides.
"""

from __future__ import annotations

import asyncio
import logging

logger = logging.getLogger(__name__)

#: The routes ``FastCycle`` serves, as the request line spells them.
FAST_PATHS = (b"/v1/completions", b"/v1/chat/completions")

try:  # uvicorn's status lines and its header-value check, for the responses written here
    from uvicorn.protocols.http.httptools_impl import HEADER_VALUE_RE, STATUS_LINE
except ImportError:  # front_protocol() returns None then: no FastCycle is ever made
    HEADER_VALUE_RE, STATUS_LINE = None, {}


class _HeadWithBody:
    """A client connection's transport that holds a response head until the next write.

    uvicorn writes a response's head and each body part separately; on a busy host every
    write to a client on the same core wakes it, so a head written alone costs the client a
    wake-up and a read before the first token. Held here, the head leaves with the first
    body part when that is written in the same event-loop turn, or alone at the end of the
    turn otherwise.
    """

    __slots__ = ("_held", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None

    def write(self, data: bytes) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._transport.write(held + data)
        elif data[:5] == b"HTTP/":
            self._held = bytes(data)
            self._loop.call_soon(self._flush)
        else:
            self._transport.write(data)

    def _flush(self) -> None:
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


class FastCycle:
    """One request on a fast route: its body, and the ASGI ``receive``/``send`` the app
    answers it through. It also serves as the request itself (``scope`` and ``receive``,
    what the proxy reads of a Starlette ``Request``), and ``take_body`` hands the body over
    without an ASGI message.

    Keeps the attribute names of uvicorn's request cycle that the protocol (connection
    lost, shutdown) and ``DirectWriter`` read. ``message_event`` is the cycle itself: the
    protocol ``set()``s it when the connection is lost.
    """

    __slots__ = (
        "_body",
        "_defaults",
        "_head",
        "_on_response",
        "_waiter",
        "chunked_encoding",
        "disconnected",
        "flow",
        "keep_alive",
        "message_event",
        "pdx_watch",
        "response_complete",
        "response_started",
        "scope",
        "size",
        "transport",
    )

    def __init__(self, protocol, path: bytes, query: bytes, headers: list, keep_alive: bool):
        self.scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.4"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path.decode("ascii"),
            "raw_path": path,
            "query_string": query,
            "root_path": "",
            "headers": headers,
            "server": protocol.server,
            "client": protocol.client,
        }
        transport = protocol.transport
        self.transport = getattr(transport, "_transport", transport)  # heads held here
        self.flow = protocol.flow
        self.keep_alive = keep_alive
        self._on_response = protocol.on_response_complete
        self._defaults = protocol.server_state  # its default headers (date) change each second
        self._body: list[bytes] = []
        self.size = 0
        self._head: bytes | None = None
        self._waiter: asyncio.Future | None = None
        self.message_event = self
        self.pdx_watch = None
        self.disconnected = False
        self.response_started = False
        self.response_complete = False
        self.chunked_encoding: bool | None = None

    def add_body(self, data: bytes, limit: int) -> None:
        """A piece of the request body; past ``limit`` bytes the rest is dropped (the app
        sees one byte over the limit and answers 413)."""
        if self.size <= limit:
            self._body.append(data[: limit + 1 - self.size])
        self.size += len(data)

    def set(self) -> None:
        """The connection is gone (``message_event.set()`` in uvicorn's terms)."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def run(self, app) -> None:
        try:
            await app(self.scope, self.receive, self.send)
        except BaseException as exc:
            logger.error("exception in the proxy app", exc_info=exc)
            if not self.response_started:
                await self._send_500()
            else:
                self.transport.close()
        else:
            if not self.response_started and not self.disconnected:
                logger.error("the proxy app returned without a response")
                await self._send_500()
            elif not self.response_complete and not self.disconnected:
                self.transport.close()
        finally:
            self._on_response = None  # no reference back to the protocol

    async def _send_500(self) -> None:
        self.keep_alive = False
        await self.send(
            {
                "type": "http.response.start",
                "status": 500,
                "headers": [(b"content-type", b"text/plain; charset=utf-8")],
            }
        )
        await self.send({"type": "http.response.body", "body": b"Internal Server Error"})

    def take_body(self) -> bytes | None:
        """The request body, once (None after); ``receive`` hands it out the same way."""
        body = self._body
        if body is None:
            return None
        self._body = None  # type: ignore[assignment]
        return body[0] if len(body) == 1 else b"".join(body)

    async def receive(self) -> dict:
        data = self.take_body()
        if data is not None:
            return {"type": "http.request", "body": data, "more_body": False}
        if not (self.disconnected or self.response_complete):
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if self.disconnected:
            return
        if not self.response_started:
            if message["type"] != "http.response.start":
                raise RuntimeError(f"expected http.response.start, got {message['type']}")
            self._head = self.begin(message["status"], message.get("headers", ()))
            return
        if self.response_complete or message["type"] != "http.response.body":
            raise RuntimeError(f"unexpected ASGI message {message['type']}")
        body = message.get("body", b"")
        more = message.get("more_body", False)
        if self.chunked_encoding:
            data = b"%x\r\n%b\r\n" % (len(body), body) if body else b""
            if not more:
                data += b"0\r\n\r\n"
        else:
            data = body
        head = self._head
        if head is not None:
            self._head = None
            data = head + data
        if data:
            self.transport.write(data)
        if not more:
            self.response_complete = True
            if not self.keep_alive:
                self.transport.close()
            on_response = self._on_response
            if on_response is not None:
                on_response()

    def begin(self, status: int, headers) -> bytes:
        """Start the response: its head, for the caller to write (with the first body part).
        ``send`` does this for ``http.response.start``; ``DirectWriter`` may, ahead of it."""
        self.response_started = True
        return self._build_head(status, headers)

    def _build_head(self, status: int, headers) -> bytes:
        parts = [STATUS_LINE[status]]
        parts.extend(b"%b: %b\r\n" % nv for nv in self._defaults.default_headers)
        chunked = None
        close = False
        for name, value in headers:
            if HEADER_VALUE_RE.search(value):
                raise RuntimeError("invalid HTTP header value")
            name = name.lower()
            if name == b"content-length":
                chunked = False
            elif name == b"transfer-encoding" and value.lower() == b"chunked":
                chunked = True
            elif name == b"connection" and b"close" in value.lower():
                self.keep_alive = False
                close = True
            parts.append(b"%b: %b\r\n" % (name, value))
        if not self.keep_alive and not close:
            parts.append(b"connection: close\r\n")
        if chunked is None and status not in (204, 304):
            chunked = True
            parts.append(b"transfer-encoding: chunked\r\n")
        self.chunked_encoding = bool(chunked)
        parts.append(b"\r\n")
        return b"".join(parts)


_PROTOCOLS: dict[int, type | None] = {}


def is_front_protocol(protocol: object) -> bool:
    """Is ``protocol`` one of ``front_protocol()``'s classes?"""
    return type(protocol) in _PROTOCOLS.values()


#: What the subclass overrides or reads of uvicorn's protocol.
_UVICORN_NEEDS = (
    "on_message_begin",
    "on_headers_complete",
    "on_body",
    "on_message_complete",
    "on_response_complete",
    "connection_made",
    "connection_lost",
)


def front_protocol(max_body_bytes: int) -> type | None:
    """The protocol class ``vllm-pd proxy`` serves with (None: no usable httptools
    protocol in this uvicorn; use uvicorn's default)."""
    if max_body_bytes in _PROTOCOLS:
        return _PROTOCOLS[max_body_bytes]
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        HttpToolsProtocol = None
    if HttpToolsProtocol is None or not all(hasattr(HttpToolsProtocol, n) for n in _UVICORN_NEEDS):
        _PROTOCOLS[max_body_bytes] = None
        return None

    class FrontProtocol(HttpToolsProtocol):
        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(_HeadWithBody(transport, asyncio.get_running_loop()))

        def connection_lost(self, exc: Exception | None) -> None:
            cycle = getattr(self, "cycle", None)
            super().connection_lost(exc)
            if cycle is not None and getattr(cycle, "disconnected", False):
                watch = getattr(cycle, "pdx_watch", None)
                if watch is not None:
                    watch._client_gone()

        def on_message_begin(self) -> None:
            # The ASGI scope is built only for requests that go uvicorn's way.
            self.url = b""
            self.expect_100_continue = False
            self.headers = []

        def on_headers_complete(self) -> None:
            parser = self.parser
            cycle = self.cycle
            if (
                parser.get_method() == b"POST"
                and (cycle is None or cycle.response_complete)
                and not self.expect_100_continue
                and parser.get_http_version() == "1.1"
                and not parser.should_upgrade()
            ):
                path, _, query = self.url.partition(b"?")
                if path in FAST_PATHS and not self._declares_too_much():
                    self.cycle = FastCycle(
                        self, path, query, self.headers, parser.should_keep_alive()
                    )
                    return
            url, headers, expect = self.url, self.headers, self.expect_100_continue
            super().on_message_begin()  # uvicorn's scope, around the headers parsed
            self.url, self.expect_100_continue = url, expect
            self.headers = self.scope["headers"] = headers
            super().on_headers_complete()

        def _declares_too_much(self) -> bool:
            for name, value in self.headers:
                if name == b"content-length":
                    return not value.isdigit() or int(value) > max_body_bytes
            return False

        def on_body(self, body: bytes) -> None:
            cycle = self.cycle
            if type(cycle) is FastCycle:
                if not cycle.response_complete:
                    cycle.add_body(body, max_body_bytes)
                return
            super().on_body(body)

        def on_message_complete(self) -> None:
            cycle = self.cycle
            if type(cycle) is FastCycle:
                if not cycle.response_complete:
                    task = self.loop.create_task(cycle.run(self.app))
                    task.add_done_callback(self.tasks.discard)
                    self.tasks.add(task)
                return
            super().on_message_complete()

    _PROTOCOLS[max_body_bytes] = FrontProtocol
    return FrontProtocol
