"""The proxy's ASGI app: OpenAI-compatible routes in front of the P/D fleet.

The two completion routes are the hot path and are dispatched in plain ASGI (``FrontDoor``);
FastAPI serves the rest (models, health, metrics, admin).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from vllm_pd_ext.proxy.client_limits import BodyBudget, BodyReader, plain_protocol
from vllm_pd_ext.proxy.config import ProxyConfig
from vllm_pd_ext.proxy.errors import ProxyError, error_body, error_response
from vllm_pd_ext.proxy.fleet import CACHE_VIEWS
from vllm_pd_ext.proxy.front_protocol import fast_cycle, front_protocol, internals_ok
from vllm_pd_ext.proxy.request import PATHS, ClientRequest, Route
from vllm_pd_ext.proxy.service import ProxyService
from vllm_pd_ext.proxy.tracing import Tracing
from vllm_pd_ext.proxy.upstream import Timeouts, UpstreamError
from vllm_pd_ext.util.auth import bearer_ok

logger = logging.getLogger(__name__)


def create_app(
    config: ProxyConfig, *, freeze_gc: bool = False, tracing: Tracing | None = None
) -> FrontDoor:
    """Build the ASGI app (FastAPI behind the front door); the fleet starts and stops with
    the app's lifespan. ``.state.service`` is the ProxyService. ``freeze_gc`` (the proxy's
    own process only): once started, everything alive is moved out of the collector's
    reach, since it lives as long as the process; full passes over it would pause requests
    for tens of milliseconds. ``tracing``: where spans go, instead of the config's
    ``otlp_traces_endpoint`` (tests)."""
    service = ProxyService(config, fast_path=config.fast_path and internals_ok(), tracing=tracing)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        if freeze_gc:
            gc.collect()
            gc.freeze()
        try:
            yield
        finally:
            await service.close()

    app = FastAPI(title="vllm-pd proxy", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.service = service

    @app.exception_handler(ProxyError)
    async def _proxy_error(request: Request, exc: ProxyError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error serving %s", request.url.path)
        return JSONResponse(error_body(500, "internal proxy error"), status_code=500)

    models_timeout = Timeouts(total=config.timeouts.health_s, connect=config.timeouts.connect_s)

    @app.get("/v1/models")
    async def models() -> Response:
        for inst in service.fleet.healthy("decode") + service.fleet.healthy("prefill"):
            try:
                status, raw = await inst.client.fetch("GET", "/v1/models", models_timeout.client())
            except UpstreamError:
                continue
            if status == 200:
                return Response(raw, media_type="application/json")
        raise ProxyError(503, "no healthy instance to list models", code="no_upstream")

    monitor_secret = config.monitor_secret()

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        decode = len(service.fleet.healthy("decode"))
        prefill = len(service.fleet.healthy("prefill"))
        if decode:
            status, state = 200, "ok"
        elif prefill and config.no_decode_fallback:  # served whole on prefill instances
            status, state = 200, "degraded_no_decode"
        else:
            status, state = 503, "no_decode"
        body: dict[str, Any] = {"status": state}
        # the status for anyone (load balancers); the fleet's size only with the token
        if monitor_secret is None or bearer_ok(request.scope, monitor_secret):
            body.update(healthy_decode=decode, healthy_prefill=prefill)
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics() -> Response:
        m = service.metrics
        for inst in service.fleet.instances():
            m.upstream_healthy.labels(inst.label, inst.role).set(1 if inst.healthy else 0)
            m.upstream_in_flight.labels(inst.label, inst.role).set(inst.in_flight)
            for view in CACHE_VIEWS:
                m.cache_view.labels(inst.label, view).set(1 if inst.cache_view == view else 0)
            free = inst.free_blocks()
            if free is not None:
                m.kv_room.labels(inst.label, inst.role).set(free)
            if inst.events is not None:
                for figure, value in inst.events.figures().items():
                    m.kv_events.labels(inst.label, figure).set(value)
        return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/admin/fleet")
    async def fleet_state() -> JSONResponse:
        return JSONResponse(
            [
                {
                    "url": i.url,
                    "role": i.role,
                    "healthy": i.healthy,
                    "in_flight": i.in_flight,
                    "running": i.running,
                    "waiting": i.waiting,
                    "kv_usage": i.kv_usage,
                    "cache_view": i.cache_view,
                    "failures": i.failures,
                    "last_error": i.last_error,
                }
                for i in service.fleet.instances()
            ]
        )

    return FrontDoor(app, config, service)


#: The hot routes: served without FastAPI's routing and dependency layers.
_COMPLETIONS: dict[str, Route] = {path: route for route, path in PATHS.items()}


class FrontDoor:
    """API key on ``/v1/*``, admin token on ``/admin/*``, metrics token (else the API key) on
    ``/metrics``; POSTs to the completion routes go straight to the service; everything else
    to FastAPI. Plain ASGI. A completion request's body that the fast path does not collect
    itself is read here, within the client limits (``client_limits.BodyReader``).

    Starlette's ``@app.middleware("http")`` wraps every request in a task group and memory
    stream; measured, that was ~17% of the proxy's CPU per request. FastAPI's routing and
    dependency solving were another few percent.
    """

    def __init__(self, app: FastAPI, config: ProxyConfig, service: ProxyService):
        self.app = app
        self.state = app.state
        self.service = service
        #: Serve through ``front_protocol``'s request cycle (the HTTP server to run this app
        #: with is ``server_protocol()``'s).
        self.fast_path = service.fast_path
        #: Request bodies held at once, over the process, on either path.
        self.body_budget = BodyBudget(config.max_buffered_body_bytes)
        self._protocol = (
            front_protocol(
                config.max_body_bytes,
                config.client_header_timeout_s,
                config.client_body_timeout_s,
                self.body_budget,
                self._head_refusal,
            )
            if self.fast_path
            else None
        )
        #: Reads the body of a completion request the fast path does not collect itself.
        self.body_reader = BodyReader(
            config.max_body_bytes, config.client_body_timeout_s, self.body_budget
        )
        self.api_key = config.api_key.get_secret_value() if config.api_key else None
        self.admin_token = config.admin_token.get_secret_value() if config.admin_token else None
        self.monitor_secret = config.monitor_secret()

    def _auth_error(self, path: str, scope: dict[str, Any]) -> ProxyError | None:
        """The 401/404 a request to ``path`` gets from its headers alone, or None."""
        if path.startswith("/v1/") and self.api_key is not None:
            if not bearer_ok(scope, self.api_key):
                return ProxyError(401, "invalid or missing API key", code="invalid_api_key")
        elif path == "/metrics" and self.monitor_secret is not None:
            if not bearer_ok(scope, self.monitor_secret):
                return ProxyError(401, "invalid or missing metrics token")
        elif path.startswith("/admin/"):
            if self.admin_token is None:
                return ProxyError(404, "admin endpoints are disabled")
            if not bearer_ok(scope, self.admin_token):
                return ProxyError(401, "invalid or missing admin token")
        return None

    def _head_refusal(self, path: bytes, headers: list[tuple[bytes, bytes]]) -> ProxyError | None:
        """The fast path's ``head_check``: a completion request's answer from its head alone
        (a bad API key, a full admission queue), before its body is read."""
        error = self._auth_error(path.decode("ascii"), {"headers": headers})
        return error if error is not None else self.service.refusal_now()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            path: str = scope["path"]
            error = self._auth_error(path, scope)
            if error is not None:
                await error_response(error)(scope, receive, send)
                return
            route = _COMPLETIONS.get(path)
            if route is not None:
                if scope["method"] != "POST":
                    error = ProxyError(405, f"{path} takes POST")
                    await error_response(error)(scope, receive, send)
                    return
                await self._complete(scope, receive, send, route)
                return
        await self.app(scope, receive, send)

    def server_settings(self) -> dict[str, Any]:
        """What uvicorn serves this app with: ``server_protocol()`` and the connection cap
        (``max_connections``: beyond it, uvicorn answers 503 on either path)."""
        return {
            "http": self.server_protocol(),
            "limit_concurrency": self.service.config.max_connections,
        }

    def server_protocol(self) -> type | str:
        """uvicorn's ``http`` setting to serve this app with: ``front_protocol``'s class on
        the fast path, else uvicorn's default protocol within the client read deadlines."""
        if self._protocol is not None:
            return self._protocol
        c = self.service.config
        return plain_protocol(c.client_header_timeout_s, c.client_body_timeout_s)

    async def _complete(self, scope, receive, send, route: Route) -> None:
        cycle = fast_cycle(receive) if self.fast_path else None
        if cycle is not None:  # the fast path collected the body within the limits
            await self._serve(cycle, cycle.take_body() or b"", scope, receive, send, route)
            return
        # uvicorn's own cycle: the body is read here, within the same limits, once the
        # request could be admitted
        try:
            refused = self.service.refusal_now()
            if refused is not None:
                raise refused
            hold = await self.body_reader.read(scope, receive)
        except ProxyError as exc:  # 408, 413, 429, 503: nothing more is read of this client
            response = error_response(exc)
            response.headers["connection"] = "close"
            await response(scope, receive, send)
            return
        if hold is None:  # the client went away
            return
        with hold:
            raw = hold.take_body()
            await self._serve(Request(scope, hold.receive), raw, scope, receive, send, route)

    async def _serve(
        self, request: ClientRequest, raw: bytes, scope, receive, send, route: Route
    ) -> None:
        try:
            response = await self.service.handle(request, route, raw)
        except ProxyError as exc:
            response = error_response(exc)
        except Exception:
            logger.exception("unexpected error serving %s", scope["path"])
            response = JSONResponse(error_body(500, "internal proxy error"), status_code=500)
        await response(scope, receive, send)
