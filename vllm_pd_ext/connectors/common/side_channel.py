"""The prefill worker's handshake server: a tiny HTTP server on the side-channel port.

``GET /handshake`` answers the worker's handshake document (engine id, transport descriptor,
KV layout and its fingerprint). POST routes hand their body to a callback: ``/write_target``
takes a decode worker's offer of where a WRITE-mode transfer should land, ``/cancel`` withdraws
one (answered only once no write into it is in flight). Bodies are JSON, capped at
:data:`MAX_BODY`. Clients: :func:`fetch_handshake` and :func:`post_json`.

With a fleet key (:mod:`vllm_pd_ext.fleet_key`) both directions are authenticated: a request
carries :data:`AUTH_HEADER` ``<timestamp>.<nonce>.<tag>``, the tag over the method, path,
timestamp, nonce and body; the server answers anything else 401 and accepts each nonce once
(:class:`~vllm_pd_ext.fleet_key.ReplayGuard`). Its answer carries the tag of the request's
nonce, the status and the answer's body, which the client checks: a handshake document or an
acknowledgement cannot be forged either. Without a key nothing is tagged or checked.
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
from typing import Any

from vllm_pd_ext import fleet_key
from vllm_pd_ext.util.throttle import Throttle

logger = logging.getLogger(__name__)

#: Largest request body the server reads.
MAX_BODY = 8 << 20
#: Connections served at once (a thread each); more are closed as they come.
MAX_CONNECTIONS = 64
#: A connection that sends nothing for this long is closed (a slow client holds no thread).
IDLE_TIMEOUT_S = 10.0
#: The header that carries a request's or an answer's fleet-key tag.
AUTH_HEADER = "X-PdExt-Auth"
#: Refusals logged at most this often (a scan must not flood the engine's log).
_WARN_EVERY_S = 10.0


def _request_tag(key: bytes, method: str, path: str, stamp: str, nonce: str, body: bytes) -> str:
    digest = hashlib.sha256(body).digest()
    return fleet_key.tag(key, "side-channel request", method, path, stamp, nonce, digest).hex()


def _answer_tag(key: bytes, nonce: str, status: int, body: bytes) -> str:
    digest = hashlib.sha256(body).digest()
    return fleet_key.tag(key, "side-channel answer", nonce, str(status), digest).hex()


_NO_HEADER = f"no valid {AUTH_HEADER} header (is this peer given the fleet key?)"


def _parse_header(header: str | None) -> tuple[str, str, str] | None:
    """(timestamp, nonce, tag) of a well-formed request header, else None."""
    stamp, _, rest = (header or "").partition(".")
    nonce, _, claimed = rest.partition(".")
    well_formed = (
        0 < len(stamp) <= 16
        and 0 < len(nonce) <= 64
        and 0 < len(claimed) <= 128
        and (stamp + nonce + claimed).isascii()
        and stamp.isdigit()
    )
    return (stamp, nonce, claimed) if well_formed else None


def _signed_headers(key: bytes | None, method: str, path: str, body: bytes) -> dict[str, str]:
    if key is None:
        return {}
    stamp, nonce = str(int(time.time() * 1000)), secrets.token_hex(16)
    value = f"{stamp}.{nonce}.{_request_tag(key, method, path, stamp, nonce, body)}"
    return {AUTH_HEADER: value}


class SideChannelError(RuntimeError):
    """The peer's side channel could not be reached or answered badly."""


class SideChannelServer:
    """Serves ``handshake`` at ``GET /handshake`` and passes POST bodies to ``post_routes``.

    Runs one daemon thread plus one per connection, at most ``max_connections`` (more are
    closed as they come); a connection idle for ``idle_timeout_s`` is closed. ``close()``
    stops it. With ``key``, only requests tagged with it are served (see the module's
    docstring); ``on_refused`` is called for each other one.
    """

    def __init__(
        self,
        host: str,
        port: int,
        handshake: Callable[[], dict[str, Any]],
        post_routes: Mapping[str, Callable[[dict[str, Any]], None]] | None = None,
        *,
        key: bytes | None = None,
        on_refused: Callable[[], None] | None = None,
        max_connections: int = MAX_CONNECTIONS,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
    ) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            timeout = idle_timeout_s  # socket timeout on every read: no slow client for ever

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

            def _authenticate(self, method: str, body: bytes) -> str | None:
                """The request's nonce if it may be served (always without a key); otherwise
                answer 401 and return None."""
                if outer._key is None:
                    return ""
                problem, nonce = outer._check_tag(
                    outer._key, method, self.path, self.headers.get(AUTH_HEADER), body
                )
                if problem is None:
                    return nonce
                outer._refuse(self.client_address[0], method, self.path, problem)
                self._reply(401, {"error": f"unauthenticated: {problem}"})
                return None

            def do_GET(self) -> None:
                nonce = self._authenticate("GET", b"")
                if nonce is None:
                    return
                if self.path != "/handshake":
                    self._reply(404, {"error": f"no route {self.path}"}, nonce)
                    return
                self._reply(200, outer._handshake(), nonce)

            def do_POST(self) -> None:
                route = outer._post_routes.get(self.path)
                if route is None:
                    self._reply(404, {"error": f"no route {self.path}"})
                    return
                try:
                    n = int(self.headers.get("Content-Length", "0"))
                    if not 0 < n <= MAX_BODY:
                        raise ValueError(f"body of {n} bytes")
                except ValueError as e:
                    self._reply(400, {"error": str(e)})
                    return
                if outer._key is not None and _parse_header(self.headers.get(AUTH_HEADER)) is None:
                    # refused before its body is read: no one without the key makes us hold it
                    outer._refuse(self.client_address[0], "POST", self.path, _NO_HEADER)
                    self._reply(401, {"error": f"unauthenticated: {_NO_HEADER}"})
                    return
                raw = self.rfile.read(n)
                nonce = self._authenticate("POST", raw)
                if nonce is None:
                    return
                try:
                    body = json.loads(raw)
                    if not isinstance(body, dict):
                        raise ValueError("body is not a JSON object")
                    route(body)
                except (ValueError, KeyError, TypeError) as e:
                    self._reply(400, {"error": str(e)}, nonce)
                    return
                self._reply(200, {"ok": True}, nonce)

        self._handshake = handshake
        self._post_routes = dict(post_routes or {})
        self._key = key
        self._replays = fleet_key.ReplayGuard()
        self._on_refused = on_refused
        self._warnings = Throttle(_WARN_EVERY_S)
        self._lock = threading.Lock()
        self.refused = 0
        try:
            self._server = _BoundedServer((host, port), Handler, max_connections)
        except OSError as e:
            raise SideChannelError(
                f"cannot bind the KV side channel on {host}:{port} ({e}); set "
                f"kv_connector_extra_config.side_channel_port (or kv_port) to a free port"
            ) from e
        self.host, self.port = host, int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.2},
            name=f"pdext-side-channel-{self.port}",
            daemon=True,
        )
        self._thread.start()

    def _check_tag(
        self, key: bytes, method: str, path: str, header: str | None, body: bytes
    ) -> tuple[str | None, str]:
        """(None, nonce) for a request tagged with ``key`` and fresh, else (why not, "")."""
        parts = _parse_header(header)
        if parts is None:
            return _NO_HEADER, ""
        stamp, nonce, claimed = parts
        if not hmac.compare_digest(claimed, _request_tag(key, method, path, stamp, nonce, body)):
            return "bad tag (a different fleet key, or the request was altered)", ""
        problem = self._replays.check(int(stamp) / 1000, nonce)
        return problem, nonce

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


class _BoundedServer(ThreadingHTTPServer):
    """A threading HTTP server that serves at most ``limit`` connections at once."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type, limit: int) -> None:
        self._slots = threading.BoundedSemaphore(limit)
        self._limit = limit
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            logger.warning(
                "KV side channel: %d connections already; closed one from %s",
                self._limit,
                client_address[0],
            )
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


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
            raw = r.read(MAX_BODY + 1)
            status, tag = r.status, r.headers.get(AUTH_HEADER)
    except urllib.error.HTTPError as e:
        detail = e.read(4096).decode("utf-8", "replace")
        raise SideChannelError(f"{method} {path} to {host}:{port}: {e.code} {detail}") from e
    except (OSError, urllib.error.URLError) as e:
        raise SideChannelError(f"{method} {path} to {host}:{port} failed: {e}") from e
    if key is not None:
        nonce = headers[AUTH_HEADER].split(".")[1]
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
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise SideChannelError(f"handshake with {host}:{port}: not JSON ({e})") from e
    if not isinstance(body, dict):
        raise SideChannelError(f"handshake with {host}:{port}: answer is not a JSON object")
    return body


def post_json(
    host: str,
    port: int,
    path: str,
    body: dict[str, Any],
    timeout: float,
    key: bytes | None = None,
) -> None:
    """POST ``body`` to a peer; :class:`SideChannelError` unless it answers 200."""
    _exchange(host, port, "POST", path, json.dumps(body).encode(), timeout, key)


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
