"""The prefill worker's handshake server: a tiny HTTP server on the side-channel port.

``GET /handshake`` answers the worker's handshake document (engine id, transport descriptor,
KV layout and its fingerprint). POST routes hand their body to a callback: ``/write_target``
takes a decode worker's offer of where a WRITE-mode transfer should land, ``/cancel`` withdraws
one (answered at once, saying whether a write into it is still in flight). A route answers 200
``{"ok": true}`` plus the fields it returns. Bodies are JSON, capped at
:attr:`SideChannelLimits.max_body_bytes`. Clients: :func:`fetch_handshake` and
:func:`post_json`.

With a fleet key (:mod:`vllm_pd_ext.fleet_key`) both directions are authenticated: a request
carries :data:`AUTH_HEADER` ``v2.<timestamp>.<nonce>.<head tag>.<body tag>``, the head tag over
the method, path, timestamp, nonce and ``Content-Length``, the body tag over the head tag and
the body. The server checks the head tag (then the timestamp and nonce, each nonce accepted
once: :class:`~vllm_pd_ext.fleet_key.ReplayGuard`) before it reads any body, and the body tag
after; it answers anything else 401. Its answer carries the tag of the request's nonce, the
status and the answer's body, which the client checks: a handshake document or an
acknowledgement cannot be forged either. Without a key nothing is tagged or checked.

Nobody can hold the server's connections (:class:`~vllm_pd_ext.util.conn_slots.ConnectionSlots`),
within :class:`SideChannelLimits` (``side_channel_limits`` in the connectors' config): at most
``max_connections``, ``max_per_source`` of them from one address; a request's head (request
line and headers, at most ``max_head_bytes``) must arrive within ``head_timeout_s`` of the
connection's start, and when all are taken the oldest connection still sending its head is
closed for a new one; after its head, a connection idle for ``idle_timeout_s`` is closed.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import secrets
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from vllm_pd_ext import fleet_key
from vllm_pd_ext.util.conn_slots import ConnectionSlots
from vllm_pd_ext.util.throttle import Throttle

logger = logging.getLogger(__name__)

#: Largest answer body a client reads.
MAX_ANSWER = 8 << 20
#: The header that carries a request's or an answer's fleet-key tag.
AUTH_HEADER = "X-PdExt-Auth"
#: The first field of :data:`AUTH_HEADER` in requests (the header's format version).
AUTH_VERSION = "v2"
#: Refusals logged at most this often (a scan must not flood the engine's log).
_WARN_EVERY_S = 10.0


def _head_tag(key: bytes, method: str, path: str, stamp: str, nonce: str, length: int) -> str:
    return fleet_key.tag(
        key, "side-channel request head", method, path, stamp, nonce, str(length)
    ).hex()


def _body_tag(key: bytes, head_tag: str, body: bytes) -> str:
    return fleet_key.tag(key, "side-channel request body", head_tag, body).hex()


def _answer_tag(key: bytes, nonce: str, status: int, body: bytes) -> str:
    digest = hashlib.sha256(body).digest()
    return fleet_key.tag(key, "side-channel answer", nonce, str(status), digest).hex()


_NO_HEADER = f"no valid {AUTH_HEADER} header (is this peer given the fleet key?)"
_OLD_HEADER = f"an {AUTH_HEADER} header of an older version (upgrade that peer)"


class _Auth(NamedTuple):
    """The fields of a request's :data:`AUTH_HEADER`."""

    stamp: str
    nonce: str
    head: str
    body: str


def _parse_header(header: str | None) -> _Auth | str:
    """The fields of a well-formed request header, else why it is not one."""
    fields = (header or "").split(".")
    if len(fields) == 3:  # <timestamp>.<nonce>.<tag>: before the head was tagged on its own
        return _OLD_HEADER
    if len(fields) != 5 or fields[0] != AUTH_VERSION:
        return _NO_HEADER
    auth = _Auth(*fields[1:])
    well_formed = (
        0 < len(auth.stamp) <= 16
        and 0 < len(auth.nonce) <= 64
        and 0 < len(auth.head) <= 64
        and 0 < len(auth.body) <= 64
        and "".join(auth).isascii()
        and auth.stamp.isdigit()
    )
    return auth if well_formed else _NO_HEADER


def _signed_headers(key: bytes | None, method: str, path: str, body: bytes) -> dict[str, str]:
    if key is None:
        return {}
    stamp, nonce = str(int(time.time() * 1000)), secrets.token_hex(16)
    head = _head_tag(key, method, path, stamp, nonce, len(body))
    value = f"{AUTH_VERSION}.{stamp}.{nonce}.{head}.{_body_tag(key, head, body)}"
    return {AUTH_HEADER: value}


class SideChannelError(RuntimeError):
    """The peer's side channel could not be reached or answered badly; ``status``: the HTTP
    status it answered with, None when it gave no answer."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class SideChannelLimits(BaseModel):
    """What one side-channel server serves at most (see the module's docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_connections: int = Field(
        64,
        ge=1,
        description="Connections served at once (a thread each); beyond it, the oldest one "
        "still sending its head is closed for a new one, or the new one is.",
    )
    max_per_source: int = Field(
        32,
        ge=1,
        description="Connections from one address at once (a decode host's workers each hold "
        "at most max_concurrent_transfers at a time); more from it are closed.",
    )
    head_timeout_s: float = Field(
        3.0, gt=0, description="A request's head must have arrived this long after it connected."
    )
    idle_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Once the head is in, a read of the body or a write of the answer may "
        "wait this long.",
    )
    max_head_bytes: int = Field(
        16 << 10, ge=1, description="Largest request head (request line and headers)."
    )
    max_body_bytes: int = Field(8 << 20, ge=1, description="Largest request body.")


#: The limits of a server given none.
DEFAULT_LIMITS = SideChannelLimits()


class SideChannelServer:
    """Serves ``handshake`` at ``GET /handshake`` and passes POST bodies to ``post_routes``.

    Runs one daemon thread plus one per connection, within ``limits`` (see the module's
    docstring). ``close()`` stops it. With ``key``, only requests tagged with it are served;
    ``on_refused`` is called for each other one.
    """

    def __init__(
        self,
        host: str,
        port: int,
        handshake: Callable[[], dict[str, Any]],
        post_routes: Mapping[str, Callable[[dict[str, Any]], dict[str, Any] | None]] | None = None,
        *,
        key: bytes | None = None,
        on_refused: Callable[[], None] | None = None,
        limits: SideChannelLimits = DEFAULT_LIMITS,
    ) -> None:
        outer = self
        self.limits = limits

        class Handler(BaseHTTPRequestHandler):
            timeout = limits.idle_timeout_s  # socket timeout on every read: no slow client for ever

            def setup(self) -> None:
                super().setup()
                self.rfile = _HeadLimit(self.rfile, limits.max_head_bytes)  # type: ignore[assignment]

            def parse_request(self) -> bool:
                ok = super().parse_request()
                assert isinstance(self.rfile, _HeadLimit)
                self.rfile = self.rfile.raw  # the body: bounded by Content-Length
                if not outer.slots.head_done(self.connection):
                    self.close_connection = True  # closed for a late head: serve nothing
                    return False
                return ok

            def log_message(self, fmt: str, *args: Any) -> None:
                logger.debug("side channel: " + fmt, *args)

            def _reply(self, status: int, body: dict[str, Any], nonce: str | None = None) -> None:
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                if outer._key is not None and nonce is not None:
                    self.send_header(AUTH_HEADER, _answer_tag(outer._key, nonce, status, raw))
                self.end_headers()
                self.wfile.write(raw)

            def _refuse(self, method: str, problem: str) -> None:
                outer._refuse(self.client_address[0], method, self.path, problem)
                self._reply(401, {"error": f"unauthenticated: {problem}"})

            def _content_length(self, method: str) -> int | None:
                """The declared body length (GET: 0 unless declared); answer 400 and return
                None when it is missing for a POST, not a number, or over ``max_body_bytes``."""
                try:
                    n = int(self.headers.get("Content-Length", "0"))
                    least = 1 if method == "POST" else 0
                    if not least <= n <= limits.max_body_bytes:
                        raise ValueError(f"body of {n} bytes")
                except ValueError as e:
                    self._reply(400, {"error": str(e)})
                    return None
                return n

            def _read(self, method: str) -> tuple[str, bytes] | None:
                """(nonce, body) of a request that may be served (nonce "" without a key);
                otherwise answer it (400, 401) and return None. With a key, the head is
                checked before any body is read: nobody without the key makes us read one."""
                n = self._content_length(method)
                if n is None:
                    return None
                key = outer._key
                if key is None:
                    return "", self.rfile.read(n) if method == "POST" else b""
                auth = _parse_header(self.headers.get(AUTH_HEADER))
                if isinstance(auth, str):
                    self._refuse(method, auth)
                    return None
                head = _head_tag(key, method, self.path, auth.stamp, auth.nonce, n)
                if not hmac.compare_digest(auth.head, head):
                    self._refuse(method, "bad tag (a different fleet key, or an altered request)")
                    return None
                problem = outer._replays.check(int(auth.stamp) / 1000, auth.nonce)
                if problem is not None:
                    self._refuse(method, problem)
                    return None
                body = self.rfile.read(n) if method == "POST" else b""
                if len(body) != n or not hmac.compare_digest(auth.body, _body_tag(key, head, body)):
                    self._refuse(method, "bad body tag (the body was altered or cut short)")
                    return None
                return auth.nonce, body

            def do_GET(self) -> None:
                request = self._read("GET")
                if request is None:
                    return
                nonce, _ = request
                if self.path != "/handshake":
                    self._reply(404, {"error": f"no route {self.path}"}, nonce)
                    return
                self._reply(200, outer._handshake(), nonce)

            def do_POST(self) -> None:
                route = outer._post_routes.get(self.path)
                if route is None:
                    self._reply(404, {"error": f"no route {self.path}"})
                    return
                request = self._read("POST")
                if request is None:
                    return
                nonce, raw = request
                try:
                    body = json.loads(raw)
                    if not isinstance(body, dict):
                        raise ValueError("body is not a JSON object")
                    answer = route(body) or {}
                except (ValueError, KeyError, TypeError) as e:
                    self._reply(400, {"error": str(e)}, nonce)
                    return
                except Exception as e:  # the route's own failure (e.g. a peer it must reach)
                    if outer._warnings.ready():
                        logger.warning("side channel: %s failed: %r", self.path, e)
                    self._reply(500, {"error": f"{type(e).__name__}: {e}"}, nonce)
                    return
                self._reply(200, {"ok": True, **answer}, nonce)

        self._handshake = handshake
        self._post_routes = dict(post_routes or {})
        self._key = key
        self._replays = fleet_key.ReplayGuard()
        self._on_refused = on_refused
        self._warnings = Throttle(_WARN_EVERY_S)
        self._lock = threading.Lock()
        self.refused = 0
        #: Who may hold a connection (refusals and closes are counted there).
        self.slots = ConnectionSlots(
            "KV side channel", limits.max_connections, limits.max_per_source, limits.head_timeout_s
        )
        try:
            self._server = _BoundedServer((host, port), Handler, self.slots)
        except OSError as e:
            raise SideChannelError(
                f"cannot bind the KV side channel on {host}:{port} ({e}); set "
                f"kv_connector_extra_config.side_channel_port (or kv_port) to a free port"
            ) from e
        self.host, self.port = host, int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": min(0.2, limits.head_timeout_s / 4)},
            name=f"pdext-side-channel-{self.port}",
            daemon=True,
        )
        self._thread.start()

    def _refuse(self, client: str, method: str, path: str, problem: str) -> None:
        with self._lock:
            self.refused += 1
        if self._warnings.ready():
            logger.warning(
                "KV side channel refused %s %s from %s: %s (%d refused so far)",
                method,
                path[:100],
                client,
                problem,
                self.refused,
            )
        if self._on_refused is not None:
            self._on_refused()

    def close(self) -> None:
        """Stop serving (bounded)."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=2.0)


class _HeadLimit:
    """A request's input while its head is read: at most ``limit`` bytes of lines."""

    def __init__(self, raw: Any, limit: int) -> None:
        self.raw, self._limit, self._left = raw, limit, limit

    def readline(self, size: int = -1) -> bytes:
        if self._left <= 0:
            raise ConnectionError(f"request head over {self._limit} bytes")
        line: bytes = self.raw.readline(self._left if size < 0 else min(size, self._left))
        self._left -= len(line)
        return line


class _BoundedServer(ThreadingHTTPServer):
    """A threading HTTP server that serves the connections ``slots`` admits."""

    daemon_threads = True
    request_queue_size = 128  # a burst of connections waits to be admitted or refused

    def __init__(self, address: tuple[str, int], handler: type, slots: ConnectionSlots) -> None:
        self.slots = slots
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.admit(request, client_address[0]):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release(request)

    def service_actions(self) -> None:
        self.slots.expire()  # runs every poll interval of serve_forever

    def handle_error(self, request: Any, client_address: Any) -> None:
        logger.debug("side channel: connection from %s ended", client_address[0], exc_info=True)


#: P/D hosts talk to each other directly: never through an HTTP proxy from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _url(host: str, port: int, path: str) -> str:
    h = f"[{host}]" if ":" in host else host
    return f"http://{h}:{port}{path}"


def _exchange(
    host: str,
    port: int,
    method: str,
    path: str,
    body: bytes | None,
    timeout: float,
    key: bytes | None,
) -> bytes:
    """One request to a peer's side channel: the answer's body if it is 200 (and, with ``key``,
    tagged by the peer under it); :class:`SideChannelError` otherwise."""
    headers = {"Content-Type": "application/json"} if body is not None else {}
    headers.update(_signed_headers(key, method, path, body or b""))
    req = urllib.request.Request(_url(host, port, path), data=body, headers=headers, method=method)
    try:
        with _OPENER.open(req, timeout=timeout) as r:
            raw = r.read(MAX_ANSWER + 1)
            status, tag = r.status, r.headers.get(AUTH_HEADER)
    except urllib.error.HTTPError as e:
        detail = e.read(4096).decode("utf-8", "replace")
        raise SideChannelError(
            f"{method} {path} to {host}:{port}: {e.code} {detail}", status=e.code
        ) from e
    except (OSError, urllib.error.URLError) as e:
        raise SideChannelError(f"{method} {path} to {host}:{port} failed: {e}") from e
    if key is not None:
        nonce = headers[AUTH_HEADER].split(".")[2]
        if not isinstance(tag, str) or not hmac.compare_digest(
            tag.encode(), _answer_tag(key, nonce, status, raw).encode()
        ):
            raise SideChannelError(
                f"{method} {path} to {host}:{port}: the answer carries no valid fleet-key tag "
                "(is that engine given the same fleet key?)"
            )
    return raw


def fetch_handshake(
    host: str, port: int, timeout: float, key: bytes | None = None
) -> dict[str, Any]:
    """``GET /handshake`` from a peer; :class:`SideChannelError` on any failure."""
    raw = _exchange(host, port, "GET", "/handshake", None, timeout, key)
    return _json_object(raw, f"handshake with {host}:{port}")


def post_json(
    host: str,
    port: int,
    path: str,
    body: dict[str, Any],
    timeout: float,
    key: bytes | None = None,
) -> dict[str, Any]:
    """POST ``body`` to a peer; its answer (a JSON object); :class:`SideChannelError` unless it
    answers 200 with one."""
    raw = _exchange(host, port, "POST", path, json.dumps(body).encode(), timeout, key)
    return _json_object(raw, f"POST {path} to {host}:{port}")


def _json_object(raw: bytes, what: str) -> dict[str, Any]:
    """A peer's answer ``raw`` as the JSON object it must be; :class:`SideChannelError`
    (its message led by ``what``) when it is not."""
    try:
        answer = json.loads(raw)
    except ValueError as e:
        raise SideChannelError(f"{what}: not JSON ({e})") from e
    if not isinstance(answer, dict):
        raise SideChannelError(f"{what}: answer is not a JSON object")
    return answer


def warn_if_exposed(host: str, what: str) -> None:
    """One WARNING line when a KV listener that authenticates nobody binds beyond loopback."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        logger.warning(
            "%s listens on %s without authentication: anyone who can reach it can read and "
            "write this engine's KV cache regions. Keep it on a private network.",
            what,
            host,
        )
