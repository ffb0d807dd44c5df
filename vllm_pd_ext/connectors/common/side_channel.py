"""The prefill worker's handshake server: a tiny HTTP server on the side-channel port.

``GET /handshake`` answers the worker's handshake document (engine id, transport descriptor,
KV layout and its fingerprint). POST routes hand their body to a callback: ``/write_target``
takes a decode worker's offer of where a WRITE-mode transfer should land, ``/cancel`` withdraws
one (answered only once no write into it is in flight). Bodies are JSON, capped at
:data:`MAX_BODY`. Clients: :func:`fetch_handshake` and :func:`post_json`.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

logger = logging.getLogger(__name__)

#: Largest request body the server reads.
MAX_BODY = 8 << 20
#: Connections served at once (a thread each); more are closed as they come.
MAX_CONNECTIONS = 64
#: A connection that sends nothing for this long is closed (a slow client holds no thread).
IDLE_TIMEOUT_S = 10.0


class SideChannelError(RuntimeError):
    """The peer's side channel could not be reached or answered badly."""


class SideChannelServer:
    """Serves ``handshake`` at ``GET /handshake`` and passes POST bodies to ``post_routes``.

    Runs one daemon thread plus one per connection, at most ``max_connections`` (more are
    closed as they come); a connection idle for ``idle_timeout_s`` is closed. ``close()``
    stops it.
    """

    def __init__(
        self,
        host: str,
        port: int,
        handshake: Callable[[], dict[str, Any]],
        post_routes: Mapping[str, Callable[[dict[str, Any]], None]] | None = None,
        *,
        max_connections: int = MAX_CONNECTIONS,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
    ) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            timeout = idle_timeout_s  # socket timeout on every read: no slow client for ever

            def log_message(self, fmt: str, *args: Any) -> None:
                logger.debug("side channel: " + fmt, *args)

            def _reply(self, status: int, body: dict[str, Any]) -> None:
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self) -> None:
                if self.path != "/handshake":
                    self._reply(404, {"error": f"no route {self.path}"})
                    return
                self._reply(200, outer._handshake())

            def do_POST(self) -> None:
                route = outer._post_routes.get(self.path)
                if route is None:
                    self._reply(404, {"error": f"no route {self.path}"})
                    return
                try:
                    n = int(self.headers.get("Content-Length", "0"))
                    if not 0 < n <= MAX_BODY:
                        raise ValueError(f"body of {n} bytes")
                    body = json.loads(self.rfile.read(n))
                    if not isinstance(body, dict):
                        raise ValueError("body is not a JSON object")
                    route(body)
                except (ValueError, KeyError, TypeError) as e:
                    self._reply(400, {"error": str(e)})
                    return
                self._reply(200, {"ok": True})

        self._handshake = handshake
        self._post_routes = dict(post_routes or {})
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


def fetch_handshake(host: str, port: int, timeout: float) -> dict[str, Any]:
    """``GET /handshake`` from a peer; :class:`SideChannelError` on any failure."""
    try:
        with _OPENER.open(_url(host, port, "/handshake"), timeout=timeout) as r:
            body = json.loads(r.read(MAX_BODY + 1))
    except (OSError, ValueError, urllib.error.URLError) as e:
        raise SideChannelError(f"handshake with {host}:{port} failed: {e}") from e
    if not isinstance(body, dict):
        raise SideChannelError(f"handshake with {host}:{port}: answer is not a JSON object")
    return body


def post_json(host: str, port: int, path: str, body: dict[str, Any], timeout: float) -> None:
    """POST ``body`` to a peer; :class:`SideChannelError` unless it answers 200."""
    req = urllib.request.Request(
        _url(host, port, path),
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with _OPENER.open(req, timeout=timeout) as r:
            r.read()
    except (OSError, urllib.error.URLError) as e:
        raise SideChannelError(f"POST {path} to {host}:{port} failed: {e}") from e


def warn_if_exposed(host: str, what: str) -> None:
    """One WARNING line when an unauthenticated KV listener binds beyond loopback."""
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
