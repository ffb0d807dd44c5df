"""The FastAPI app: vLLM-compatible render / derender routes, health, metrics, models.

Bodies are read and validated here (not by FastAPI) so that every client mistake -- malformed
JSON, an oversized body, a schema violation, a prompt over the context length -- becomes an
OpenAI error body with status 400 (404 for an unknown model), never a 500.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, SecretStr, ValidationError
from starlette.routing import Route

from vllm_pd_ext import derender_stream as wire
from vllm_pd_ext.render_server.derender import Derenderer, StreamSession
from vllm_pd_ext.render_server.errors import (
    RenderError,
    SchemaError,
    body_for,
    error_body,
    validation_message,
)
from vllm_pd_ext.render_server.openapi import build_openapi
from vllm_pd_ext.render_server.parsers import TOOL_PARSERS, reasoning_active, reasoning_parser
from vllm_pd_ext.render_server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DerenderChatRequest,
    DerenderChatStreamRequest,
    DerenderCompletionRequest,
    DerenderCompletionStreamRequest,
)
from vllm_pd_ext.render_server.renderer import Renderer
from vllm_pd_ext.render_server.settings import API_KEY_ENV, RenderSettings
from vllm_pd_ext.render_server.tokenizer import load_tokenizer
from vllm_pd_ext.util.auth import bearer_ok
from vllm_pd_ext.util.logs import bind_request, trace_id_of

logger = logging.getLogger(__name__)

#: Environment variable carrying the settings JSON to uvicorn worker processes.
SETTINGS_ENV = "VLLM_PD_RENDER_SETTINGS"

try:  # optional: a faster JSON codec when installed (it comes with vLLM); same JSON either way
    import orjson as _orjson
except ImportError:  # pragma: no cover - exercised where orjson is absent
    _orjson = None  # type: ignore[assignment, unused-ignore]  # typed only where orjson is installed


def _json_loads(data: bytes) -> Any:
    if _orjson is not None:
        try:
            return _orjson.loads(data)
        except _orjson.JSONDecodeError:
            pass  # let the stdlib parser produce the error message (and accept NaN etc.)
    return json.loads(data)


def _json_response(content: Any, status_code: int = 200) -> Response:
    if _orjson is not None:
        try:
            return Response(
                _orjson.dumps(content), status_code=status_code, media_type="application/json"
            )
        except TypeError:
            pass  # e.g. ints beyond 64 bits: the stdlib encoder handles them
    return JSONResponse(content, status_code=status_code)


def _json_bytes(content: Any) -> bytes:
    """``content`` encoded as ``_json_response`` sends it."""
    if _orjson is not None:
        try:
            return _orjson.dumps(content)
        except TypeError:
            pass
    return bytes(JSONResponse(content).body)


class _Metrics:
    """Prometheus metrics of one worker process (a private registry per app)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter(
            "vllm_pd_render_requests",
            "Requests handled, by route and HTTP status.",
            ["route", "status"],
            registry=self.registry,
        )
        self.seconds = Histogram(
            "vllm_pd_render_request_seconds",
            "Time spent handling a request (server side), by route.",
            ["route"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "vllm_pd_render_prompt_tokens",
            "Prompt tokens produced by render routes.",
            registry=self.registry,
        )
        self.output_tokens = Counter(
            "vllm_pd_render_derendered_tokens",
            "Output tokens consumed by derender routes.",
            registry=self.registry,
        )


def _check_tool_parser(settings: RenderSettings, tok: Any) -> None:
    """Build the built-in tool parser once at startup, so a tokenizer it cannot work with
    stops the server with a clear message instead of failing every tool request."""
    name = settings.tool_call_parser
    if name in TOOL_PARSERS:
        try:
            TOOL_PARSERS[name](tok)
        except RenderError as exc:
            raise ValueError(
                f"--tool-call-parser {name} does not fit the tokenizer of {settings.model}: "
                f"{exc.message}"
            ) from None


def _check_reasoning_parser(settings: RenderSettings, tok: Any) -> None:
    """Build the built-in reasoning parser once at startup as vLLM's startup check builds it
    (no chat template kwargs), so a tokenizer it cannot work with stops the server with
    vLLM's message instead of failing every chat request."""
    name = settings.reasoning_parser
    if name is None or settings.uses_vllm_parsers or not reasoning_active(name, {}):
        return
    try:
        reasoning_parser(tok, name)
    except RenderError as exc:
        raise ValueError(
            f"--reasoning-parser {name} cannot be used with the tokenizer of "
            f"{settings.model!r}: {exc.message}"
        ) from None


#: Requests whose rendering waits for the CPU thread, at most; more are answered 503.
MAX_PENDING = 1024
#: Chunks of a streaming derender call up to this many bytes (a few tokens' worth, well under
#: a millisecond of work) are derendered on the event loop when the CPU thread is idle (still
#: one tokenizer user at a time), sparing every streamed token two thread hand-offs.
INLINE_BYTES = 16 * 1024


class _State:
    def __init__(self, settings: RenderSettings) -> None:
        tok = load_tokenizer(
            settings.model, settings.resolved_chat_template(), fast_bpe=settings.fast_bpe
        )
        tok.warm_up()
        _check_tool_parser(settings, tok)
        _check_reasoning_parser(settings, tok)
        self.settings = settings
        self.renderer = Renderer(settings, tok)
        self.derenderer = Derenderer(
            settings, tok, self.renderer.max_model_len, self.renderer.chat_template_kwargs
        )
        self.metrics = _Metrics()
        self.created = int(time.time())
        #: Rendering and derendering run here, one at a time as before, so the event loop
        #: stays free for reading bodies, /health and /metrics while a large request computes
        #: (the process's parallelism is its worker processes, not threads).
        self.cpu = ThreadPoolExecutor(max_workers=1, thread_name_prefix="render-cpu")
        #: jobs on (or waiting for) the CPU thread
        self.pending = 0
        #: long-lived streaming derender calls open now
        self.streams = 0


async def _read_json(request: Request, limit: int) -> Any:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise RenderError(f"request body of {length} bytes exceeds the limit of {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise RenderError(f"request body exceeds the limit of {limit} bytes")
    try:
        return _json_loads(bytes(body))
    except (ValueError, RecursionError) as exc:
        pos = getattr(exc, "pos", None)  # vLLM's param: the offset where decoding failed
        param = f"body.{pos}" if isinstance(pos, int) else "body"
        raise SchemaError(f"malformed JSON body: {exc}", param=param) from None


def _validate(model: type[BaseModel], data: Any) -> Any:
    if not isinstance(data, dict):
        raise SchemaError("request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        message, param = validation_message(exc.errors(include_url=False, include_input=False))
        raise SchemaError(message, param=param) from None


class _Gone(Exception):
    """The caller of a streaming call disconnected."""


class _Lines:
    """The lines of a request body as they arrive (a partial line waits for its end or for
    the body's end); no line longer than ``limit`` bytes."""

    def __init__(self, receive: Any, limit: int) -> None:
        self.receive = receive
        self.limit = limit
        self.buf = b""
        self.ended = False

    async def take(self, timeout: float) -> list[bytes]:
        """The complete non-blank lines buffered, waiting up to ``timeout`` seconds for at
        least one (``TimeoutError``); ``[]`` once the body has ended."""
        while True:
            if b"\n" in self.buf:
                *lines, self.buf = self.buf.split(b"\n")
                lines = [ln for ln in lines if ln.strip()]
                if lines:
                    return lines
            if len(self.buf) > self.limit:
                raise RenderError(f"a line of the body exceeds the limit of {self.limit} bytes")
            if self.ended:
                last, self.buf = self.buf, b""
                return [last] if last.strip() else []
            message = await asyncio.wait_for(self.receive(), timeout)
            if message["type"] != "http.request":
                raise _Gone
            self.buf += message.get("body", b"")
            self.ended = not message.get("more_body", False)


def create_app(settings: RenderSettings) -> FastAPI:
    """The render server app for ``settings``; the tokenizer loads at startup."""
    holder: dict[str, _State] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        holder["state"] = created = _State(settings)
        yield
        for st in {created, holder.pop("state", created)}:  # and one state() made meanwhile
            st.cpu.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="vllm-pd-ext render server", lifespan=lifespan)

    def state() -> _State:
        if "state" not in holder:  # TestClient without lifespan, or a very early request
            holder["state"] = _State(settings)
        return holder["state"]

    async def handle(route: str, request: Request, fn: Callable[[Any], Any]) -> Response:
        st = state()
        started = time.perf_counter()
        status = 200
        headers = request.headers
        bind_request(headers.get("x-request-id"), trace_id_of(headers.get("traceparent")))
        try:
            data = await _read_json(request, st.settings.max_body_bytes)
            if st.pending >= MAX_PENDING:
                raise RenderError(
                    f"{MAX_PENDING} requests are waiting already; retry later",
                    status=503,
                    err_type="ServiceUnavailableError",
                )
            st.pending += 1
            try:
                result = await asyncio.get_running_loop().run_in_executor(st.cpu, fn, data)
            finally:
                st.pending -= 1
            response: Response = _json_response(result)
        except RenderError as exc:
            status = exc.status
            response = JSONResponse(body_for(exc), status_code=status)
        except Exception as exc:  # a bug of ours: still an OpenAI body, logged with a stack
            logger.exception("unexpected error on %s", route)
            status = 500
            response = JSONResponse(
                error_body(
                    f"internal error: {type(exc).__name__}",
                    err_type="InternalServerError",
                    code=500,
                ),
                status_code=500,
            )
        elapsed = time.perf_counter() - started
        st.metrics.requests.labels(route, str(status)).inc()
        st.metrics.seconds.labels(route).observe(elapsed)
        logger.debug("%s: HTTP %d in %.1f ms", route, status, elapsed * 1e3)
        return response

    def _request_id(request: Request) -> str | None:
        return request.headers.get("x-request-id")

    @app.post("/v1/chat/completions/render")
    async def render_chat(request: Request) -> Response:
        rid = _request_id(request)

        def run(data: Any) -> Any:
            out = state().renderer.render_chat(_validate(ChatCompletionRequest, data), rid)
            state().metrics.prompt_tokens.inc(len(out["token_ids"]))
            return out

        return await handle("chat_render", request, run)

    @app.post("/v1/completions/render")
    async def render_completion(request: Request) -> Response:
        rid = _request_id(request)

        def run(data: Any) -> Any:
            out = state().renderer.render_completion(_validate(CompletionRequest, data), rid)
            state().metrics.prompt_tokens.inc(sum(len(o["token_ids"]) for o in out))
            return out

        return await handle("completion_render", request, run)

    @app.post("/v1/chat/completions/derender")
    async def derender_chat(request: Request) -> Response:
        def run(data: Any) -> Any:
            d = state().derenderer
            if isinstance(data, dict) and data.get("stream") is True:
                req = _validate(DerenderChatStreamRequest, data)
                _count(req.generate_chunk.choices)
                return d.chat_stream(req)
            req = _validate(DerenderChatRequest, data)
            _count(req.generate_response.choices)
            return d.chat(req)

        return await handle("chat_derender", request, run)

    @app.post("/v1/completions/derender")
    async def derender_completion(request: Request) -> Response:
        def run(data: Any) -> Any:
            d = state().derenderer
            if isinstance(data, dict) and data.get("stream") is True:
                req = _validate(DerenderCompletionStreamRequest, data)
                _count(req.generate_chunk.choices)
                return d.completion_stream(req)
            req = _validate(DerenderCompletionRequest, data)
            for gen in req.generate_responses:
                _count(gen.choices)
            return d.completion(req)

        return await handle("completion_derender", request, run)

    async def derender_stream(kind: str, scope: Any, receive: Any, send: Any) -> None:
        """The long-lived streaming derender call (``vllm_pd_ext.derender_stream``)."""
        st = state()
        heads = {k: v for k, v in scope["headers"] if k in (b"x-request-id", b"traceparent")}
        rid = heads.get(b"x-request-id")
        bind_request(rid.decode("latin-1") if rid else None, trace_id_of(heads.get(b"traceparent")))
        route = f"{'chat' if kind == 'chat' else 'completion'}_derender_stream"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + st.settings.derender_stream_max_s
        max_events = st.renderer.max_model_len + 64
        lines = _Lines(receive, st.settings.max_body_bytes)
        status = 200
        started = False

        async def respond(exc: RenderError) -> None:
            nonlocal status
            status = exc.status
            if started:
                payload = _json_bytes(body_for(exc))
                await send(
                    {"type": "http.response.body", "body": wire.event(payload), "more_body": True}
                )
            else:
                await JSONResponse(body_for(exc), status_code=exc.status)(scope, receive, send)

        async def next_lines() -> list[bytes]:
            left = deadline - loop.time()
            idle = st.settings.derender_stream_idle_s
            try:
                return await lines.take(max(0.0, min(idle, left)))
            except asyncio.TimeoutError:
                what = f"no line within {idle:g} s" if idle < left else "the call's time is up"
                raise RenderError(
                    f"streaming derender: {what}", status=408, err_type="TimeoutError"
                ) from None

        def run(session: StreamSession, raw: list[bytes]) -> tuple[bytes, RenderError | None]:
            out = []
            t0, tokens = time.perf_counter(), session.tokens
            try:
                for one in raw:
                    try:
                        data = _json_loads(one)
                    except (ValueError, RecursionError) as exc:
                        raise SchemaError(f"malformed JSON line: {exc}") from None
                    out.append(wire.event(_json_bytes(session.chunk(data))))
            except RenderError as exc:
                return b"".join(out), exc
            except Exception as exc:  # a bug of ours: still an OpenAI body, logged with a stack
                logger.exception("unexpected error on %s", route)
                error = RenderError(
                    f"internal error: {type(exc).__name__}",
                    status=500,
                    err_type="InternalServerError",
                )
                return b"".join(out), error
            finally:
                st.metrics.output_tokens.inc(session.tokens - tokens)
                st.metrics.seconds.labels(route).observe(time.perf_counter() - t0)
            return b"".join(out), None

        if st.streams >= st.settings.max_derender_streams:
            await respond(
                RenderError(
                    f"{st.settings.max_derender_streams} streaming derender calls are open "
                    "already; derender per event",
                    status=503,
                    err_type="ServiceUnavailableError",
                )
            )
            st.metrics.requests.labels(route, str(status)).inc()
            return
        st.streams += 1
        try:
            pending = await next_lines()
            if not pending:
                raise SchemaError("empty body: line 1 must be the stream's context")
            try:
                context = _json_loads(pending[0])
            except (ValueError, RecursionError) as exc:
                raise SchemaError(f"malformed JSON in line 1: {exc}") from None
            if not isinstance(context, dict):
                raise SchemaError("line 1 must be a JSON object")
            st.pending += 1
            try:
                session = await loop.run_in_executor(
                    st.cpu, StreamSession, st.derenderer, kind, context
                )
            finally:
                st.pending -= 1
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"text/event-stream"),
                        (b"cache-control", b"no-cache"),
                    ],
                }
            )
            started = True
            events, pending = 0, pending[1:]
            while True:
                if not pending:
                    pending = await next_lines()
                    if not pending:
                        break
                events += len(pending)
                if events > max_events:
                    raise RenderError(f"a streaming call takes at most {max_events} chunks")
                if st.pending == 0 and sum(map(len, pending)) <= INLINE_BYTES:
                    out, error = run(session, pending)  # the CPU thread is idle: no hand-off
                else:
                    st.pending += 1
                    try:
                        out, error = await loop.run_in_executor(st.cpu, run, session, pending)
                    finally:
                        st.pending -= 1
                pending = []
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
                if error is not None:
                    raise error
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except RenderError as exc:
            await respond(exc)
            if started:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except _Gone:
            status = 499  # the caller left; nothing to answer
        finally:
            st.streams -= 1
            st.metrics.requests.labels(route, str(status)).inc()

    for kind, path in wire.PATHS.items():
        app.router.routes.append(Route(path, _Endpoint(derender_stream, kind), methods=["POST"]))

    def _count(choices: list[Any]) -> None:
        state().metrics.output_tokens.inc(sum(len(c.token_ids or []) for c in choices))

    @app.get("/health")
    async def health() -> Response:
        state()
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(state().metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        st = state()
        return {
            "object": "list",
            "data": [
                {
                    "id": st.settings.model_name,
                    "object": "model",
                    "created": st.created,
                    "owned_by": "vllm-pd-ext",
                    "root": st.settings.model,
                    "parent": None,
                    "max_model_len": st.renderer.max_model_len,
                    "permission": [],
                }
            ],
        }

    @app.exception_handler(404)
    async def not_found(request: Request, exc: Exception) -> Response:
        return JSONResponse(
            error_body(f"no route {request.url.path}", err_type="NotFoundError", code=404),
            status_code=404,
        )

    @app.exception_handler(405)
    async def not_allowed(request: Request, exc: Exception) -> Response:
        return JSONResponse(
            error_body(
                f"method {request.method} not allowed on {request.url.path}",
                err_type="MethodNotAllowed",
                code=405,
            ),
            status_code=405,
        )

    app.openapi = lambda: build_openapi(app)  # type: ignore[method-assign]
    if settings.api_key is not None:
        app.add_middleware(_ApiKey, secret=settings.api_key.get_secret_value())
    return app


class _Endpoint:
    """A plain ASGI endpoint (a route that reads its body while it answers)."""

    def __init__(self, handler: Callable[..., Any], kind: str) -> None:
        self.handler = handler
        self.kind = kind

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.handler(self.kind, scope, receive, send)


class _ApiKey:
    """Every route but ``/health`` needs ``Authorization: Bearer <api key>`` (plain ASGI: no
    task group per request)."""

    def __init__(self, app: Any, secret: str) -> None:
        self.app = app
        self.secret = secret

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        needs_key = scope["type"] == "http" and scope["path"] != "/health"
        if needs_key and not bearer_ok(scope, self.secret):
            body = error_body("invalid or missing API key", err_type="Unauthorized", code=401)
            await JSONResponse(body, status_code=401)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def app_from_env() -> FastAPI:
    """uvicorn factory for worker processes: settings come from :data:`SETTINGS_ENV`, the
    API key from :data:`API_KEY_ENV`."""
    settings = RenderSettings.model_validate_json(os.environ[SETTINGS_ENV])
    key = os.environ.get(API_KEY_ENV)
    if key:
        settings = settings.model_copy(update={"api_key": SecretStr(key)})
    return create_app(settings)
