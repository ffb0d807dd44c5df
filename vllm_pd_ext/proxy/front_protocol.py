"""The proxy's HTTP/1.1 server protocol, and everything else the proxy reads or writes of
uvicorn's private internals: they live in this module only.

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
(``_HeadWithBody``). ``DirectWriter`` writes a started response's body parts straight to the
client's transport.

The fence: ``missing_internals()`` lists what of uvicorn this module needs and the installed
uvicorn lacks (methods, attributes its code sets, module constants); ``front_protocol()``
returns None when anything is missing, after one WARNING line, and the proxy then serves
through uvicorn's own protocol and the plain ASGI interface (``ProxyConfig.fast_path: false``
does the same on purpose). Every other function here answers None or False when the fast path
is off, so nothing outside this module touches uvicorn's internals.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Callable
from typing import cast

from vllm_pd_ext.proxy.client_limits import BUSY_MESSAGE, BodyBudget, body_timeout_error
from vllm_pd_ext.proxy.errors import ProxyError, error_body

logger = logging.getLogger(__name__)

#: How long the rest of a request refused from its head (its answer already written) may
#: take to arrive and be dropped before the connection is closed.
REFUSED_BODY_S = 2.0
#: The routes ``FastCycle`` serves, as the request line spells them.
FAST_PATHS = (b"/v1/completions", b"/v1/chat/completions")

try:  # uvicorn's protocol and request cycle, and the status lines and header-value check
    # they write responses with (used for the responses written here)
    from uvicorn.protocols.http import httptools_impl as _impl
except ImportError:  # no httptools: front_protocol() returns None, no FastCycle is made
    _impl = None  # type: ignore[assignment]
# (None only where no FastCycle is ever made)
STATUS_LINE = cast("dict[int, bytes]", getattr(_impl, "STATUS_LINE", {}))
HEADER_VALUE_RE = cast("re.Pattern[bytes]", getattr(_impl, "HEADER_VALUE_RE", None))


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

    def is_closing(self) -> bool:  # asked after every response: not through __getattr__
        return self._transport.is_closing()

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
        "_budget",
        "_defaults",
        "_head",
        "_on_response",
        "_waiter",
        "body_complete",
        "chunked_encoding",
        "disconnected",
        "flow",
        "held",
        "keep_alive",
        "message_event",
        "over_budget",
        "pdx_watch",
        "response_complete",
        "response_started",
        "scope",
        "size",
        "transport",
    )

    def __init__(
        self,
        protocol,
        path: bytes,
        query: bytes,
        headers: list,
        keep_alive: bool,
        budget: BodyBudget,
    ):
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
        self.body_complete = False
        self.size = 0
        self._budget, self.held, self.over_budget = budget, 0, False
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
        sees one byte over the limit and answers 413), and past the process's body budget
        all of it (the request is answered 503)."""
        if self.size <= limit and not self.over_budget:
            part = data[: limit + 1 - self.size]
            if self._budget.take(len(part)):
                self._body.append(part)
                self.held += len(part)
            else:
                self.over_budget = True
                self._body = []
                self.release()
        self.size += len(data)

    def release(self) -> None:
        """Give the body's bytes back to the budget (once)."""
        self._budget.give(self.held)
        self.held = 0

    def set(self) -> None:
        """The connection is gone (``message_event.set()`` in uvicorn's terms)."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def run(self, app) -> None:
        if self.over_budget:
            await self._send_busy()
            return
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
            self.release()

    async def _send_busy(self) -> None:
        logger.warning(
            "answered 503: request bodies held at once would pass %d bytes", self._budget.limit
        )
        self.keep_alive = False
        body = json.dumps(error_body(503, BUSY_MESSAGE, code="body_budget")).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await self.send({"type": "http.response.start", "status": 503, "headers": headers})
        await self.send({"type": "http.response.body", "body": body})

    def write_error(self, error: ProxyError) -> None:
        """Answer with ``error``'s OpenAI error body at once, outside the app, on a request
        whose body will not be used; the connection closes after it."""
        self.keep_alive = False
        self.release()
        body = json.dumps(error.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        headers += [(k.lower().encode(), v.encode()) for k, v in error.headers().items()]
        self.transport.write(self.begin(error.status, headers) + body)
        self.response_complete = True

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
        parts = [STATUS_LINE[status], _default_lines(self._defaults.default_headers)]
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


#: The server's default headers (``ServerState.default_headers``, a list uvicorn replaces
#: when the date changes, once a second) and their lines, as last written.
_DEFAULTS: list = [None, b""]


def _default_lines(default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """The response head lines of the server's default headers (made once per list)."""
    if default_headers is not _DEFAULTS[0]:
        _DEFAULTS[1] = b"".join(b"%b: %b\r\n" % nv for nv in default_headers)
        _DEFAULTS[0] = default_headers  # held here, so its identity is not reused
    return _DEFAULTS[1]


#: What this module uses of uvicorn, by where it lives. Methods and attributes are checked
#: against the names the installed classes' code uses (an attribute a class sets in
#: ``__init__`` is not on the class itself).
_NEEDS: dict[str, tuple[str, ...]] = {
    # overridden or called by FrontProtocol; read by FastCycle and the cycle lookups
    "HttpToolsProtocol": (
        "on_message_begin",
        "on_headers_complete",
        "on_body",
        "on_message_complete",
        "on_response_complete",
        "connection_made",
        "connection_lost",
        "cycle",
        "parser",
        "url",
        "headers",
        "scope",
        "expect_100_continue",
        "flow",
        "transport",
        "server",
        "client",
        "server_state",
        "tasks",
        "loop",
        "app",
        "limit_concurrency",
        "connections",
    ),
    # read by DirectWriter and the disconnect hook on uvicorn's own request cycle
    "RequestResponseCycle": (
        "disconnected",
        "response_started",
        "response_complete",
        "chunked_encoding",
        "flow",
        "transport",
        "on_response",
        "message_event",
    ),
    "FlowControl": ("write_paused", "drain"),
    "ServerState": ("default_headers",),
    "module": ("STATUS_LINE", "HEADER_VALUE_RE"),
}


def _names_used(cls: type) -> set[str]:
    """Every name the code of ``cls`` and its bases defines or refers to."""
    names: set[str] = set()
    for klass in cls.__mro__:
        names.update(vars(klass))
        for value in vars(klass).values():
            code = getattr(value, "__code__", None)
            stack = [code] if code is not None else []
            while stack:
                code = stack.pop()
                names.update(code.co_names)
                stack.extend(c for c in code.co_consts if hasattr(c, "co_names"))
    return names


def missing_internals() -> list[str]:
    """What this module needs of uvicorn that the installed uvicorn lacks (empty: none)."""
    if _impl is None:
        return ["uvicorn.protocols.http.httptools_impl (is httptools installed?)"]
    try:
        from uvicorn.protocols.http.flow_control import FlowControl
        from uvicorn.server import ServerState
    except ImportError as exc:
        return [str(exc)]
    owners = {
        "HttpToolsProtocol": getattr(_impl, "HttpToolsProtocol", None),
        "RequestResponseCycle": getattr(_impl, "RequestResponseCycle", None),
        "FlowControl": FlowControl,
        "ServerState": ServerState,
    }
    missing: list[str] = []
    for owner, needed in _NEEDS.items():
        if owner == "module":
            missing.extend(f"httptools_impl.{n}" for n in needed if not hasattr(_impl, n))
            continue
        cls = owners[owner]
        if cls is None:
            missing.append(owner)
            continue
        used = _names_used(cls)
        missing.extend(f"{owner}.{n}" for n in needed if n not in used)
    return missing


_CHECKED: list[bool] = []


def internals_ok() -> bool:
    """Does the installed uvicorn have everything this module uses? Checked once per
    process; when not, one WARNING line says what is missing."""
    if not _CHECKED:
        missing = missing_internals()
        if missing:
            import uvicorn

            logger.warning(
                "uvicorn %s lacks %s: the proxy serves through uvicorn's own request cycle "
                "(fast path off)",
                getattr(uvicorn, "__version__", "?"),
                ", ".join(missing),
            )
        _CHECKED.append(not missing)
    return _CHECKED[0]


# -- the server's housekeeping tick ----------------------------------------------------

#: Seconds between the server's housekeeping ticks (uvicorn's: 0.1). What a tick does (the
#: date header, once a second; the exit and request-limit checks) needs no more often.
TICK_S = 1.0
#: What ``quiet_server`` overrides or calls of ``uvicorn.server.Server``.
_SERVER_NEEDS = ("main_loop", "on_tick", "handle_exit", "should_exit")


def _wake(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def quiet_server(config):
    """A ``uvicorn.Server`` for ``config`` whose housekeeping tick runs once a second instead
    of ten times: ten wake-ups a second cost an idle server ~1.7 ms of CPU a second (a bare
    uvicorn app, measured), each one paid again by whatever request runs after it on a cold
    cache. uvicorn's tick refreshes the date header every tenth tick: every tick here (the
    same once a second). A signal to exit (SIGINT, SIGTERM) ends the wait at once;
    ``should_exit`` set any other way is seen within ``TICK_S``. uvicorn's own server where
    the installed one lacks what this overrides (one DEBUG line)."""
    from uvicorn.server import Server

    missing = [n for n in _SERVER_NEEDS if n not in _names_used(Server)]
    if missing:
        logger.debug("uvicorn's Server lacks %s: its own tick", ", ".join(missing))
        return Server(config)

    class QuietServer(Server):
        _pdx_loop: asyncio.AbstractEventLoop | None = None
        _pdx_woken: asyncio.Future | None = None

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            loop, woken = self._pdx_loop, self._pdx_woken
            if loop is not None and woken is not None and not loop.is_closed():
                loop.call_soon_threadsafe(_wake, woken)

        async def main_loop(self) -> None:
            loop = self._pdx_loop = asyncio.get_running_loop()
            counter = 0
            should_exit = await self.on_tick(counter)
            while not should_exit:
                counter = (counter + 10) % 864000  # uvicorn's count of 0.1 s ticks
                woken = self._pdx_woken = loop.create_future()
                timer = loop.call_later(TICK_S, _wake, woken)
                await woken
                timer.cancel()
                should_exit = await self.on_tick(counter)

    return QuietServer(config)


#: Told a fast-path request's path and headers once its head is in, before any of its body
#: is read: an error to answer at once (the body is then read and dropped), or None.
HeadCheck = Callable[[bytes, list[tuple[bytes, bytes]]], "ProxyError | None"]


def is_front_protocol(protocol: object) -> bool:
    """Is ``protocol`` an instance of one of ``front_protocol()``'s classes?"""
    return getattr(type(protocol), "pdx_front", False)


def front_protocol(
    max_body_bytes: int,
    head_s: float = 10.0,
    body_s: float = 60.0,
    budget: BodyBudget | None = None,
    head_check: HeadCheck | None = None,
) -> type | None:
    """A protocol class ``vllm-pd proxy`` serves with on the fast path (None: the
    installed uvicorn lacks what it needs; serve with uvicorn's default protocol).

    Request bodies held at once, over all connections the class serves, stay within
    ``budget`` (:class:`BodyBudget`, 1 GiB when not given).

    A request's head must arrive within ``head_s`` (from the connection, or from the request's
    first byte) and its body within ``body_s`` after the head, else the connection is closed:
    a client that trickles bytes holds no connection for ever (uvicorn times out only idle
    keep-alive connections).

    ``head_check`` decides on a completion request from its head alone (API key, a full
    admission queue): a request it refuses is answered before its body is read, and the body
    is dropped as it arrives, never held.
    """
    if not internals_ok():
        return None
    shared_budget = budget if budget is not None else BodyBudget(1 << 30)

    class FrontProtocol(_impl.HttpToolsProtocol):
        pdx_front = True
        body_budget = shared_budget  # shared by every connection this class serves
        _read_timer: asyncio.TimerHandle | None = None
        _read_by: float | None = None  # when what is being read is due (loop time)

        def _read_within(self, seconds: float) -> None:
            """Close the connection unless what is being read arrives within ``seconds``.

            One timer per connection, not one per request: it is armed only when none is
            due by the new limit; one that fires early finds the limit later (the next
            request's, or none) and re-arms for it, or stops."""
            by = self._read_by = self.loop.time() + seconds
            timer = self._read_timer
            if timer is None or timer.when() > by:
                if timer is not None:
                    timer.cancel()
                self._read_timer = self.loop.call_at(by, self._read_due)

        def _read_done(self) -> None:
            self._read_by = None  # the timer stays: the next request likely reuses it

        def _read_due(self) -> None:
            self._read_timer = None
            by = self._read_by
            if by is None:
                return
            if self.loop.time() < by:
                self._read_timer = self.loop.call_at(by, self._read_due)
                return
            self._read_by = None
            self._read_too_slow()

        def _read_too_slow(self) -> None:
            cycle = self.cycle
            if (  # its body is late (not the head of a request pipelined behind it)
                type(cycle) is FastCycle and not cycle.body_complete and not cycle.response_started
            ):
                cycle.write_error(body_timeout_error(body_s))
            logger.debug("closed a client connection that sent its request too slowly")
            self.transport.close()

        def connection_made(self, transport) -> None:
            held = _HeadWithBody(transport, asyncio.get_running_loop())
            super().connection_made(held)  # type: ignore[arg-type]  # a transport, delegating
            self._read_within(head_s)

        def connection_lost(self, exc: Exception | None) -> None:
            self._read_by = None
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None
            cycle = getattr(self, "cycle", None)
            if type(cycle) is FastCycle and not cycle.response_started:
                cycle.release()  # its body will not be used (run() releases it too: once)
            super().connection_lost(exc)
            if cycle is not None and getattr(cycle, "disconnected", False):
                watch = getattr(cycle, "pdx_watch", None)
                if watch is not None:
                    watch._client_gone()

        def on_message_begin(self) -> None:
            self._read_within(head_s)
            # The ASGI scope is built only for requests that go uvicorn's way.
            self.url = b""
            self.expect_100_continue = False
            self.headers: list[tuple[bytes, bytes]] = []

        def on_headers_complete(self) -> None:
            self._read_within(body_s)
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
                if path in FAST_PATHS and not self._declares_too_much() and not self._full():
                    # FastCycle stands in for uvicorn's cycle where the protocol reads one
                    fast = FastCycle(
                        self, path, query, self.headers, parser.should_keep_alive(), shared_budget
                    )
                    self.cycle = fast  # type: ignore[assignment]
                    refused = head_check(path, self.headers) if head_check is not None else None
                    if refused is not None:  # answered now; the body is dropped as it comes
                        fast.write_error(refused)
                        self._read_within(min(body_s, REFUSED_BODY_S))
                    return
            url, headers, expect = self.url, self.headers, self.expect_100_continue
            super().on_message_begin()  # uvicorn's scope, around the headers parsed
            self.url, self.expect_100_continue = url, expect
            self.headers = self.scope["headers"] = headers
            super().on_headers_complete()

        def _full(self) -> bool:
            """uvicorn's own ``limit_concurrency`` test: past it, its cycle answers 503."""
            limit = self.limit_concurrency
            return limit is not None and (
                len(self.connections) >= limit or len(self.tasks) >= limit
            )

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
            self._read_done()
            cycle = self.cycle
            if type(cycle) is FastCycle:
                cycle.body_complete = True
                if not cycle.response_complete:
                    task = self.loop.create_task(cycle.run(self.app))
                    task.add_done_callback(self.tasks.discard)
                    self.tasks.add(task)
                elif not cycle.keep_alive:  # answered from its head: the body is in, dropped
                    self.transport.close()
                return
            super().on_message_complete()

    return FrontProtocol


# -- the request cycle behind an ASGI callable ---------------------------------------------


def fast_cycle(receive) -> FastCycle | None:
    """The ``FastCycle`` serving the request ``receive`` belongs to, if one does."""
    cycle = getattr(receive, "__self__", None)
    return cycle if type(cycle) is FastCycle else None


def hooked_cycle(receive):
    """The request cycle behind ``receive`` when its connection is served by
    ``FrontProtocol`` (a ``FastCycle``, or uvicorn's httptools cycle, whose
    ``connection_lost`` tells the cycle's ``pdx_watch``); else None."""
    cycle = getattr(receive, "__self__", None)
    if type(cycle) is FastCycle:
        return cycle
    if cycle is None or _impl is None or type(cycle) is not _impl.RequestResponseCycle:
        return None
    protocol = getattr(cycle.on_response, "__self__", None)
    return cycle if is_front_protocol(protocol) else None


class DirectWriter:
    """Writes body parts of a started chunked response straight to the client's transport,
    outside the ASGI ``send`` (what uvicorn's httptools cycle writes for a body part, less
    the coroutine, the message dict and the task wake-up around it).

    ``ready()`` says whether a part may go this way now: not once the client is gone, the
    response complete, or the transport's buffer over its high-water mark (the ASGI ``send``
    then waits for it to drain). The last part of a response always goes through ``send``.
    """

    __slots__ = ("_cycle", "_flow", "_headers", "_transport")

    def __init__(self, cycle, headers: list[tuple[bytes, bytes]] | None = None):
        self._cycle = cycle
        self._flow = cycle.flow
        self._transport = cycle.transport
        self._headers = headers  # not None: the response is not started yet

    @staticmethod
    def before_start(cycle, headers: list[tuple[bytes, bytes]]) -> DirectWriter | None:
        """A writer whose first write starts the response itself (status 200, ``headers``,
        chunked) ahead of the ASGI ``send``: the first events go out from the engine
        connection's receive callback instead of after the request's task wakes. Only on a
        ``FastCycle`` not started yet; None otherwise."""
        if type(cycle) is not FastCycle or cycle.response_started:
            return None
        return DirectWriter(cycle, headers)

    @property
    def started(self) -> bool:
        """Has this writer started the response (or found it started)?"""
        return self._headers is None

    @staticmethod
    def for_send(send) -> DirectWriter | None:
        """A writer for the response ``send`` belongs to, when it is a ``FastCycle`` or
        uvicorn's httptools cycle with a chunked response under way; None otherwise (other
        servers, tests)."""
        cycle = getattr(send, "__self__", None)
        if type(cycle) is not FastCycle and (
            _impl is None or type(cycle) is not _impl.RequestResponseCycle
        ):
            return None
        if cycle.chunked_encoding is not True or not cycle.response_started:
            return None
        return DirectWriter(cycle)

    def ready(self) -> bool:
        cycle = self._cycle
        if self._headers is not None and cycle.response_started:
            return False  # started through ``send``: its head may not be out yet
        return not (cycle.disconnected or cycle.response_complete or self._flow.write_paused)

    def write(self, data: bytes) -> None:
        headers = self._headers
        if headers is not None:
            self._headers = None
            head = self._cycle.begin(200, headers)
            self._transport.write(b"%b%x\r\n%b\r\n" % (head, len(data), data))
            return
        self._transport.write(b"%x\r\n%b\r\n" % (len(data), data))
