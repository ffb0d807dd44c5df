"""Token mode: render the OpenAI request to token ids, derender the engine's tokens back.

With a render tier configured (``ProxyConfig.render``: our ``vllm-pd render`` or vLLM's
``vllm launch render``), the proxy sends the client's request to a render server
(``/v1/chat/completions/render`` or ``/v1/completions/render``), which answers a ready-to-send
GenerateRequest; both legs then go to the engines' ``POST /inference/v1/generate`` (``vllm serve
--enable-scale-out`` or ``--tokens-only``). The decode leg's tokens come back through derender:
one ``/derender`` call for a whole answer, or streaming derender calls with the ``stream_state``
carried from call to call: one per engine event, except that token events which arrived
together (while the previous call was in flight) go as one (``coalesce``), so a slow call
does not queue a call per token behind it. A render server of ours also takes a streamed
answer as one long-lived call (``vllm_pd_ext.derender_stream``: the context once, then each
chunk as a line, its derendered events read back as they come), so a token costs incremental
detokenisation only, not a request that resends the prompt, and every engine event stays its
own client event, as in text mode; a render tier without that route (vLLM's) is derendered per
event, counted by reason (``per_event``). The client sees normal OpenAI responses.

Everything here runs on the proxy's event loop; the render servers are plain upstreams with
the same pooled client and error kinds as the engines.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_pd_ext import derender_stream as wire
from vllm_pd_ext.proxy import tracing
from vllm_pd_ext.proxy.errors import ProxyError, passthrough, sse_error
from vllm_pd_ext.proxy.request import RequestContext
from vllm_pd_ext.proxy.upstream import Timeouts, Upstream, UpstreamError, UpstreamResponse
from vllm_pd_ext.transfer_params import STEERING_FIELDS, without_steering

logger = logging.getLogger(__name__)

#: The engines' abort route for requests sent to ``request.GENERATE_PATH``.
ABORT_PATH = "/inference/v1/abort_requests"

_RENDER_PATHS = {"chat": "/v1/chat/completions/render", "completions": "/v1/completions/render"}
_DERENDER_PATHS = {
    "chat": "/v1/chat/completions/derender",
    "completions": "/v1/completions/derender",
}


def engine_request_id(request_id: str) -> str:
    """The id vLLM's generate route gives a request sent with ``X-Request-Id: request_id``
    (what ``/inference/v1/abort_requests`` takes)."""
    return f"generate-tokens-{request_id}"


def prompt_request_id(request_id: str, index: int) -> str:
    """The ``X-Request-Id`` of prompt ``index`` of a request with several prompts (each is
    its own engine request; the first keeps the request's id)."""
    return request_id if index == 0 else f"{request_id}-p{index}"


@dataclass
class TokenRequest:
    """One request after render: the GenerateRequest body and the prompt's token ids.

    A completion request with a list of prompts renders to one GenerateRequest per prompt:
    the first is this one, the others are in ``more`` (sent to the same engine, colocated,
    and answered as one response, as vLLM answers such a request).
    """

    generate: dict[str, Any]
    prompt_ids: list[int]
    #: The OpenAI id the client sees (``chatcmpl-...`` / ``cmpl-...``), from render.
    response_id: str
    more: list[TokenRequest] = field(default_factory=list)

    @property
    def prompts(self) -> list[TokenRequest]:
        """Every prompt's request, this one first."""
        return [self, *self.more]

    @classmethod
    def from_render(cls, rendered: dict[str, Any], stream: bool) -> TokenRequest:
        generate = dict(rendered)
        generate["stream"] = stream
        # The proxy's own params, never a render tier's: explicit and empty (colocated) until
        # a split sets them, so none left in extra_args reach the connectors.
        generate["kv_transfer_params"] = {}
        generate["ec_transfer_params"] = None
        sampling = generate.get("sampling_params")
        if isinstance(sampling, dict):
            extra = sampling.get("extra_args")
            if isinstance(extra, dict) and any(name in extra for name in STEERING_FIELDS):
                kept = without_steering(extra)
                generate["sampling_params"] = {**sampling, "extra_args": kept or None}
        ids = generate.get("token_ids")
        if not isinstance(ids, list) or not ids:
            raise ProxyError(502, "render returned no token_ids", code="render_failed")
        return cls(generate, ids, str(generate.get("request_id") or ""))


def generate_leg(
    generate: dict[str, Any], params: dict[str, Any] | None, *, max_tokens: int | None = None
) -> dict[str, Any]:
    """A generate body carrying ``params``; ``max_tokens`` set makes it a one-shot,
    unstreamed leg (the prefill leg, or a drain)."""
    body = dict(generate)
    if params is not None:
        body["kv_transfer_params"] = dict(params)
    if max_tokens is not None:
        sampling = dict(body.get("sampling_params") or {})
        sampling["max_tokens"] = max_tokens
        sampling["min_tokens"] = 0
        body["sampling_params"] = sampling
        body["stream"] = False
        body["stream_options"] = None
    return body


class RenderTier:
    """The render servers: round-robin, failing over to the next on a connection error.

    A render server that refuses connections is skipped for ``backoff_s``. 4xx answers are the
    client's mistakes and pass through; anything else is a 502 ``render_failed``. A render
    server found without the long-lived streaming derender route is not asked again for
    ``recheck_s``; ``per_event(reason)`` is told of each streamed answer derendered per
    event instead.
    """

    def __init__(
        self,
        urls: tuple[str, ...],
        *,
        timeout_s: float,
        connect_s: float,
        max_connections: int,
        backoff_s: float = 2.0,
        api_key: str | None = None,
        per_event: Callable[[str], None] | None = None,
        recheck_s: float = 300.0,
        stream_calls: bool = True,
    ):
        self.upstreams = [Upstream(u, max_connections=max_connections) for u in urls]
        self._down_until = [0.0] * len(urls)
        #: until when each render server is taken to lack the streaming route
        self._no_stream_until = [0.0] * len(urls)
        self._next = 0
        self._backoff_s = backoff_s
        self._recheck_s = recheck_s
        self._timeout = Timeouts(total=timeout_s, connect=connect_s).client()
        #: a streaming call: no limit on its life, ``timeout_s`` on each wait for its answer
        self._stream_timeout = Timeouts(connect=connect_s, read=timeout_s).client()
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._per_event = per_event
        #: False: streamed answers always go per event (a comparison's baseline)
        self.stream_calls = stream_calls

    async def close(self) -> None:
        for upstream in self.upstreams:
            await upstream.close()

    def _order(self) -> list[int]:
        n = len(self.upstreams)
        start, self._next = self._next, (self._next + 1) % n
        order = [(start + i) % n for i in range(n)]
        now = time.monotonic()
        up = [i for i in order if self._down_until[i] <= now]
        return up or order  # all down: try them anyway

    async def call(self, path: str, body: dict[str, Any], request_id: str) -> Any:
        """POST ``body`` to one render server; its JSON answer. Raises ``ProxyError``."""
        errors: list[str] = []
        headers = {"X-Request-Id": request_id, **self._auth}
        trace = tracing.current()
        if trace is not None:  # the render server's lines name the trace
            headers["traceparent"] = trace.traceparent()
        for i in self._order():
            upstream = self.upstreams[i]
            try:
                status, raw = await upstream.fetch("POST", path, self._timeout, body, headers)
            except UpstreamError as exc:
                if exc.down:
                    self._down_until[i] = time.monotonic() + self._backoff_s
                    errors.append(f"{upstream.base_url}: {exc.kind}")
                    continue
                raise ProxyError(
                    502, f"render server {upstream.base_url}: {exc.kind}", code="render_failed"
                ) from None
            if status == 401:  # the proxy's configuration, not the client's mistake
                raise ProxyError(
                    502,
                    f"render server {upstream.base_url} refused the proxy's render_api_key",
                    code="render_failed",
                )
            if 400 <= status < 500:
                raise passthrough(status, raw)
            if status != 200:
                text = raw[:500].decode("utf-8", "replace")
                raise ProxyError(
                    502,
                    f"render server {upstream.base_url}: HTTP {status}: {text}",
                    code="render_failed",
                )
            try:
                return json.loads(raw)
            except ValueError:
                raise ProxyError(
                    502, f"render server {upstream.base_url}: not JSON", code="render_failed"
                ) from None
        raise ProxyError(
            502, "no render server reachable: " + "; ".join(errors), code="render_failed"
        )

    async def open_stream(
        self, route: str, lines: bytes, request_id: str
    ) -> UpstreamResponse | None:
        """Open a long-lived streaming derender call whose body starts with ``lines`` (the
        context, then chunks); its 200 response, the body left open. None when no render
        server serves the route (or all are full): the caller derenders per event, and
        ``per_event`` has been told why. Raises ``ProxyError``."""
        reason = "no_stream_route" if self.stream_calls else "stream_calls_off"
        errors: list[str] = []
        headers = {"X-Request-Id": request_id, "Content-Type": wire.CONTENT_TYPE, **self._auth}
        trace = tracing.current()
        if trace is not None:
            headers["traceparent"] = trace.traceparent()
        for i in self._order() if self.stream_calls else ():
            if self._no_stream_until[i] > time.monotonic():
                continue
            upstream = self.upstreams[i]
            try:
                resp = await upstream.send(
                    "POST", wire.PATHS[route], self._stream_timeout, lines, headers, body_open=True
                )
            except UpstreamError as exc:
                if exc.down:
                    self._down_until[i] = time.monotonic() + self._backoff_s
                    errors.append(f"{upstream.base_url}: {exc.kind}")
                    continue
                raise ProxyError(
                    502, f"render server {upstream.base_url}: {exc.kind}", code="render_failed"
                ) from None
            if resp.status == 200:
                return resp
            try:
                raw = await resp.read()
            except UpstreamError:
                raw = b""
            finally:
                resp.close()
            if resp.status in wire.ROUTE_MISSING:
                self._no_stream_until[i] = time.monotonic() + self._recheck_s
                logger.warning(
                    "render server %s has no streaming derender route (HTTP %d): streamed "
                    "answers it derenders go per event; asking again in %.0f s",
                    upstream.base_url,
                    resp.status,
                    self._recheck_s,
                )
                continue
            if resp.status == 503:
                reason = "stream_refused"
                errors.append(f"{upstream.base_url}: HTTP 503")
                continue
            if resp.status == 401:
                raise ProxyError(
                    502,
                    f"render server {upstream.base_url} refused the proxy's render_api_key",
                    code="render_failed",
                )
            if 400 <= resp.status < 500:
                raise passthrough(resp.status, raw)
            text = raw[:500].decode("utf-8", "replace")
            raise ProxyError(
                502,
                f"render server {upstream.base_url}: HTTP {resp.status}: {text}",
                code="render_failed",
            )
        if errors and reason == "no_stream_route" and len(errors) == len(self.upstreams):
            raise ProxyError(
                502, "no render server reachable: " + "; ".join(errors), code="render_failed"
            )
        logger.debug("request %s: derendered per event (%s)", request_id, reason)
        if self._per_event is not None:
            self._per_event(reason)
        return None

    async def render_request(self, ctx: RequestContext) -> TokenRequest:
        """Render the client's request; the prompt's exact length replaces the estimate."""
        started = time.perf_counter()
        tokens = await self.render(ctx.route, ctx.body, ctx.request_id, ctx.stream)
        ctx.est_prompt_tokens = len(tokens.prompt_ids)
        logger.debug(
            "request %s: rendered %d prompt tokens in %.1f ms",
            ctx.request_id,
            len(tokens.prompt_ids),
            (time.perf_counter() - started) * 1e3,
        )
        return tokens

    async def render(
        self, route: str, body: dict[str, Any], request_id: str, stream: bool
    ) -> TokenRequest:
        """The client's OpenAI request as token ids. Raises ``ProxyError``."""
        rendered = await self.call(_RENDER_PATHS[route], body, request_id)
        if not isinstance(rendered, list):
            rendered = [rendered]
        if not rendered or not all(isinstance(r, dict) for r in rendered):
            raise ProxyError(502, "render returned no GenerateRequest", code="render_failed")
        first, *more = (TokenRequest.from_render(r, stream) for r in rendered)
        for other in more:
            other.response_id = first.response_id  # one response answers them all
        first.more = more
        return first

    async def derender(
        self,
        route: str,
        body: dict[str, Any],
        tokens: TokenRequest,
        responses: list[dict[str, Any]],
        request_id: str,
    ) -> dict[str, Any]:
        """Whole generate responses (one per prompt, ``tokens.prompts``) as the OpenAI
        response. Raises ``ProxyError``."""
        prompts = tokens.prompts
        responses = [{**r, "request_id": tokens.response_id} for r in responses]
        if route == "chat":
            req = {
                "model": body.get("model"),
                "generate_response": responses[0],
                "prompt_tokens": len(tokens.prompt_ids),
                "prompt_token_ids": tokens.prompt_ids,
                "chat_request": body,
            }
        else:
            req = {
                "model": body.get("model"),
                "generate_responses": responses,
                "prompt_tokens": [len(t.prompt_ids) for t in prompts],
                "prompt_token_ids": [t.prompt_ids for t in prompts],
                "completion_request": body,
            }
        trace = tracing.current()
        span = trace.child("derender", calls=1) if trace is not None else None
        out = await self.call(_DERENDER_PATHS[route], req, request_id)
        if trace is not None:
            trace.done(span)
        if not isinstance(out, dict):
            raise ProxyError(502, "derender returned no response", code="render_failed")
        if route == "completions" and body.get("return_token_ids"):
            # What text mode's engine adds; derender leaves it to the frontend.
            gens = [
                (gen, t.prompt_ids)
                for t, r in zip(prompts, responses, strict=True)
                for gen in r.get("choices") or []
            ]
            for choice, (gen, prompt_ids) in zip(out.get("choices") or [], gens, strict=False):
                choice["token_ids"] = gen.get("token_ids")
                choice["prompt_token_ids"] = prompt_ids
        return out


#: The keys of a generate stream choice that coalesce: token ids and logprobs are appended,
#: the later chunk's finish and stop reasons win. A choice with any other key set (routed
#: experts, a sampling mask, weight versions) stays on its own.
_COALESCING = frozenset({"index", "token_ids", "logprobs", "finish_reason", "stop_reason"})


def _token_chunk(event: bytes) -> dict[str, Any] | None:
    """The generate stream chunk of an SSE event; None for anything else."""
    if not event.startswith(b"data: {"):
        return None
    try:
        chunk = json.loads(event[6:])
    except ValueError:
        return None
    return chunk if isinstance(chunk, dict) and "choices" in chunk else None


def _merged(first: dict[str, Any], then: dict[str, Any]) -> bool:
    """Append ``then``'s tokens to ``first`` (both token-mode chunks of one unfinished
    choice, ``then`` with nothing but tokens at the top); False, both unchanged, when they
    do not coalesce."""
    if set(then) - {"request_id", "choices", "output_mode", "usage", "prompt_token_ids"}:
        return False
    if then.get("usage") is not None or then.get("prompt_token_ids") is not None:
        return False
    modes = {first.get("output_mode", "tokens"), then.get("output_mode", "tokens")}
    if modes != {"tokens"} or first.get("request_id") != then.get("request_id"):
        return False
    choices = first.get("choices"), then.get("choices")
    if not all(isinstance(c, list) and len(c) == 1 and isinstance(c[0], dict) for c in choices):
        return False
    a, b = choices[0][0], choices[1][0]  # type: ignore[index]
    if a.get("finish_reason") is not None or a.get("index") != b.get("index"):
        return False
    if {k for c in (a, b) for k, v in c.items() if v is not None} - _COALESCING:
        return False
    ids_a, ids_b = a.get("token_ids") or [], b.get("token_ids") or []
    logprobs_a, logprobs_b = a.get("logprobs"), b.get("logprobs")
    if not (isinstance(ids_a, list) and isinstance(ids_b, list)):
        return False
    if (logprobs_a is None) != (logprobs_b is None):
        return False
    if logprobs_a is not None:
        content_a = logprobs_a.get("content") if isinstance(logprobs_a, dict) else None
        content_b = logprobs_b.get("content") if isinstance(logprobs_b, dict) else None
        if not (isinstance(content_a, list) and isinstance(content_b, list)):
            return False
        logprobs_a["content"] = content_a + content_b
    a["token_ids"] = ids_a + ids_b
    a["finish_reason"] = b.get("finish_reason")
    a["stop_reason"] = b.get("stop_reason")
    return True


def coalesce(events: list[bytes]) -> list[bytes | dict[str, Any]]:
    """``events`` (SSE events without their blank line) with runs of token chunks of one
    choice merged: each run as one parsed chunk; every other event as it came."""
    out: list[bytes | dict[str, Any]] = []
    for event in events:
        chunk = _token_chunk(event)
        if chunk is None:
            out.append(event)
            continue
        last = out[-1] if out else None
        if isinstance(last, dict) and _merged(last, chunk):
            continue
        out.append(chunk)
    return out


def _broken(what: str) -> ProxyError:
    return ProxyError(502, f"streaming derender: {what}", code="render_failed")


#: The most bytes of derendered events read back for one ``DerenderStream.feed``.
MAX_STREAM_ANSWER_BYTES = 16 * 1024 * 1024


@dataclass
class DerenderStream:
    """One streamed answer's derender side: engine SSE events in, OpenAI SSE events out.

    The first token chunk opens a long-lived streaming call (``RenderTier.open_stream``), on
    which each engine event becomes one client event, however the events arrived; where none
    opens, token events that arrived together are merged (``coalesce``) and each is one
    per-event call carrying the ``stream_state`` kept here. For the same chunks both give
    the same bytes. Engine events that are
    not token chunks (an error event, ``[DONE]``) pass through unchanged; ``[DONE]`` ends
    the streaming call. ``close`` drops a call still open (the answer broke off).
    """

    tier: RenderTier
    route: str
    body: dict[str, Any]
    tokens: TokenRequest
    request_id: str
    state: dict[str, Any] | None = None
    failed: bool = field(default=False)
    #: None until the first chunk; then True (one streaming call) or False (per event)
    streaming: bool | None = None
    _call: UpstreamResponse | None = None
    _answers: AsyncIterator[bytes] | None = None
    _buffer: bytes = b""
    #: tracing: the request's trace, and the derender span from the first event to close
    _trace: tracing.RequestTrace | None = field(default_factory=tracing.current)
    _span: Any = None

    async def feed(self, events: bytes) -> bytes:
        """Complete SSE events (each ending in a blank line) as the client's events."""
        if self.failed:
            return events
        if self._trace is not None and self._span is None:
            self._span = self._trace.child("derender")
        raw = events[:-2].split(b"\n\n")
        answers: list[bytes] = []
        items: list[bytes | dict[str, Any]] = []
        if self.streaming is not False:
            # one event per engine event, as text mode sends them: on the streaming call an
            # event costs a line, so nothing is gained by merging those that came together
            items = [_token_chunk(event) or event for event in raw]
            chunks = [item for item in items if isinstance(item, dict)]
            if chunks:
                answers = await self._stream(chunks)
        if self.streaming is False:  # per event: a call each, so merge what came together
            items = coalesce(raw)
        out: list[bytes] = []
        at = 0
        for item in items:
            if isinstance(item, bytes):  # an error event or [DONE]: as the engine wrote it
                out.append(item)
                if item == b"data: [DONE]":
                    await self._end()
            elif at < len(answers):
                out.append(answers[at])
                at += 1
            elif self.failed:  # after a failed call: the engine's tokens as they came
                out.append(b"data: " + json.dumps(item, separators=(",", ":")).encode())
            else:
                out.append(await self._one(item))
        return b"\n\n".join(out) + b"\n\n"

    def close(self) -> None:
        """Drop a streaming call still open (the render server sees the disconnect)."""
        call, self._call = self._call, None
        if call is not None:
            call.close()
        if self._trace is not None:
            mode = "per_event" if self.streaming is False else "stream"
            self._trace.done(self._span, mode=mode)

    # -- one streaming call ------------------------------------------------------------

    async def _stream(self, chunks: list[dict[str, Any]]) -> list[bytes]:
        """The events for ``chunks`` over the streaming call (opened by the first); [] when
        none could open (the chunks go per event). After a failure: the events before it,
        then one error event."""
        for chunk in chunks:
            chunk["request_id"] = self.tokens.response_id
        body = b"".join(wire.line(chunk) for chunk in chunks)
        try:
            if self.streaming is None:
                context: dict[str, Any] = {
                    "model": self.body.get("model"),
                    "prompt_tokens": len(self.tokens.prompt_ids),
                    "prompt_token_ids": self.tokens.prompt_ids,
                    "chat_request" if self.route == "chat" else "completion_request": self.body,
                }
                call = await self.tier.open_stream(
                    self.route, wire.line(context) + body, self.request_id
                )
                self.streaming = call is not None
                if call is None:
                    return []
                self._call, self._answers = call, call.chunks()
            else:
                if self._call is None:
                    raise _broken("the call is closed")
                self._call.write(body)
            return await self._read(len(chunks))
        except ProxyError as exc:
            self.streaming = True  # no per-event calls after a failure
            self.failed = True
            self.close()
            logger.warning("request %s: streaming derender failed: %s", self.request_id, exc)
            return [sse_error(exc.status, exc.message)[:-2]]

    async def _read(self, n: int) -> list[bytes]:
        """The next ``n`` events of the call, each as the per-event path writes it. Raises
        ``ProxyError``."""
        assert self._answers is not None
        events: list[bytes] = []
        while len(events) < n:
            while b"\n\n" not in self._buffer:
                if len(self._buffer) > MAX_STREAM_ANSWER_BYTES:
                    raise _broken("event too long")
                try:
                    piece = await self._answers.__anext__()
                except StopAsyncIteration:
                    piece = b""
                except UpstreamError as exc:
                    raise _broken(exc.kind) from None
                if not piece:
                    raise _broken("the answer ended early")
                self._buffer += piece
            raw, self._buffer = self._buffer.split(b"\n\n", 1)
            if not raw.startswith(b"data: "):
                raise _broken("not an SSE event")
            try:
                payload = json.loads(raw[6:])
            except ValueError:
                raise _broken("not JSON") from None
            error = wire.error_of(payload)
            if error is not None:
                code = error.get("code")
                status = code if isinstance(code, int) and 400 <= code < 600 else 502
                if status < 500:
                    raise passthrough(status, raw[6:])
                raise _broken(str(error.get("message"))[:500])
            if not isinstance(payload, dict):
                raise _broken("no chunk")
            events.append(b"data: " + json.dumps(payload, separators=(",", ":")).encode())
        return events

    async def _end(self) -> None:
        """End the call's body and read its answer to the end (the connection is then
        reused); a call that does not end cleanly is closed."""
        call = self._call
        if call is None or self._answers is None:
            return
        call.end_body()
        try:
            async for piece in self._answers:
                if piece.strip():
                    break  # an event nobody asked for: close
            else:
                return
        except UpstreamError:
            pass
        finally:
            self.close()

    # -- per event ---------------------------------------------------------------------

    async def _one(self, chunk: dict[str, Any]) -> bytes:
        chunk["request_id"] = self.tokens.response_id
        req: dict[str, Any] = {
            "stream": True,
            "model": self.body.get("model"),
            "generate_chunk": chunk,
            "stream_state": self.state,
            "prompt_tokens": len(self.tokens.prompt_ids),
            "prompt_token_ids": self.tokens.prompt_ids,
            "chat_request" if self.route == "chat" else "completion_request": self.body,
        }
        try:
            answer = await self.tier.call(_DERENDER_PATHS[self.route], req, self.request_id)
        except ProxyError as exc:
            self.failed = True
            logger.warning("request %s: streaming derender failed: %s", self.request_id, exc)
            return sse_error(exc.status, exc.message)[:-2]
        self.state = answer.get("stream_state")
        return b"data: " + json.dumps(answer.get("chunk"), separators=(",", ":")).encode()
