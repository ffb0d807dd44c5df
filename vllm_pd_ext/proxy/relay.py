"""The answer on its way back to the client: a whole JSON answer, or a stream of events.

Both hide ``kv_transfer_params`` from the client and report the prefill side's cache hits as
``cached_tokens`` (the decode instance counts the KV it received as cached; the client cares
about what the prefill instance found in its prefix cache). In token mode the engine's tokens
go through derender first (one call for a whole answer; when streaming, one long-lived call
or one per event: ``token_mode.DerenderStream``).

A stream measures the time to first token, the gaps between writes to the client (ITL) and,
for a split, the gap between the prefill leg's end and the first token (the KV transfer plus
decode admission), which feeds the decision's cost model. A stream that breaks after its
head ends with one SSE error event; a client that leaves while it streams cancels the decode
request (and, in token mode, aborts it on the engines).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from time import perf_counter
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse

from vllm_pd_ext.proxy.background import Background
from vllm_pd_ext.proxy.call import Call
from vllm_pd_ext.proxy.client_channel import STREAM_END, RelayResponse
from vllm_pd_ext.proxy.decision import Decider
from vllm_pd_ext.proxy.errors import ProxyError, sse_error
from vllm_pd_ext.proxy.fleet import Fleet, Instance
from vllm_pd_ext.proxy.front_protocol import DirectWriter
from vllm_pd_ext.proxy.metrics import ProxyMetrics
from vllm_pd_ext.proxy.token_mode import DerenderStream, RenderTier
from vllm_pd_ext.proxy.upstream import UpstreamError, UpstreamResponse, json_object
from vllm_pd_ext.util import jsonb

if TYPE_CHECKING:
    from vllm_pd_ext.proxy.migration import Migrator

logger = logging.getLogger(__name__)


#: ``JSONResponse.render``'s encoder, made once (``json.dumps`` with arguments makes one a call).
_JSON = json.JSONEncoder(ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))


class JSONAnswer(JSONResponse):
    """A whole answer for the client: what ``JSONResponse(content, headers={"X-Request-Id":
    request_id})`` is (status 200, the same body and head, in the same order), made in one
    call instead of eight."""

    def __init__(self, content: Any, request_id: str):
        self.status_code = 200
        self.background = None
        self.body = body = _JSON.encode(content).encode("utf-8")
        self.raw_headers = [
            (b"x-request-id", request_id.encode("latin-1")),
            (b"content-length", b"%d" % len(body)),
            (b"content-type", b"application/json"),
        ]


@dataclass(slots=True)
class Opened:
    """A decode leg whose engine answered 200; its body not read yet."""

    response: UpstreamResponse
    instance: Instance


class Relay:
    """Answers clients from opened decode legs."""

    def __init__(
        self,
        fleet: Fleet,
        metrics: ProxyMetrics,
        decider: Decider,
        background: Background,
        render: Callable[[], RenderTier | None],
        fast_path: bool,
        migrator: Migrator | None = None,
    ):
        self.fleet = fleet
        self.migrator = migrator
        self.metrics = metrics
        self.decider = decider
        self.background = background
        self._render = render
        self.fast_path = fast_path

    def first_token(self, call: Call, now: float) -> None:
        """The first token reached the client at ``now``."""
        metrics = self.metrics
        metrics.child(metrics.ttft, call.ctx.route, call.label).observe(now - call.start)
        record_transfer(metrics, self.decider, call, now)
        if call.trace is not None:  # tracing
            call.trace.first_token(now, call.prefill_done)

    # -- a whole answer ----------------------------------------------------------------

    async def whole(self, call: Call, opened: Opened) -> JSONResponse:
        """Read the engine's answer and answer the client with it."""
        ctx = call.ctx
        moves = 0
        while True:
            try:
                data = await call.watch.race(self.read(opened), "decode")
                break
            except ProxyError as exc:  # decode_failed: asked again elsewhere, if it may
                again = None
                if self.migrator is not None:
                    again = await call.watch.race(
                        self.migrator.rerun(call, opened.instance, exc.message, moves), "decode"
                    )
                if again is None:
                    raise
                opened, moves = again, moves + 1
        if ctx.tokens is not None:
            render = self._render()
            assert render is not None
            data = await call.watch.race(
                render.derender(ctx.route, ctx.body, ctx.tokens, [data], ctx.request_id), "decode"
            )
        patch_payload(data, call.cached)
        call.finish("ok", f"ok via {opened.instance.label}")
        return JSONAnswer(data, ctx.echo_id)

    async def read(self, opened: Opened) -> dict[str, Any]:
        """An opened leg's whole answer, the JSON object it must be (its response closed).
        Raises ``ProxyError`` (502 ``decode_failed``)."""
        resp, inst = opened.response, opened.instance
        try:
            raw = await resp.read()
        except UpstreamError as exc:
            self.fleet.upstream_failed(inst, exc)
            raise ProxyError(
                502, f"decode instance failed: {exc.kind}", code="decode_failed"
            ) from None
        finally:
            resp.close()
        data = json_object(raw)
        if data is None:
            raise ProxyError(
                502,
                f"decode instance {inst.label} answered with no JSON object",
                code="decode_failed",
            )
        return data

    # -- a stream ----------------------------------------------------------------------

    def stream(self, call: Call, opened: Opened, relay: StreamRelay) -> RelayResponse:
        """The client's streamed response; it ends the call when it ends."""
        direct = relay if self.fast_path and call.ctx.tokens is None else None
        return RelayResponse(
            self._events(call, opened, relay), call.watch, relay.headers, direct=direct
        )

    async def _events(self, call: Call, opened: Opened, relay: StreamRelay) -> AsyncIterator[bytes]:
        """The engine's events as the client gets them.

        In text mode, once the response's head is out, ``relay`` takes the engine's bytes as
        they are parsed and writes its events to the client itself (``DirectWriter``); what
        it leaves (the last event, anything while the client's buffer is full, the end of
        the stream or a break in it) comes through here, in order.
        """
        ctx = call.ctx
        resp, inst = opened.response, opened.instance
        outcome = "ok"
        derender = None
        if ctx.tokens is not None:
            render = self._render()
            assert render is not None
            derender = DerenderStream(render, ctx.route, ctx.body, ctx.tokens, ctx.request_id)
        elif self.fast_path:
            resp.set_sink(relay.sink)
        migration = call.migration
        try:
            while True:
                broke: str | None = None
                try:
                    async for chunk in resp.chunks():
                        if derender is None:
                            ready = relay.events(chunk, time.perf_counter())
                            if ready is None:
                                continue
                        else:
                            ready = relay.split(chunk)
                            if ready is not None and migration is not None:
                                ready = migration.feed(ready)  # its record (migration.py)
                            if not ready:
                                continue
                            ready = await derender.feed(ready)
                            relay.observe(ready, time.perf_counter())  # after the derender call
                        yield ready
                    if migration is not None:
                        broke = migration.broken()
                    elif relay.buffer.strip():
                        yield relay.buffer
                except UpstreamError as exc:
                    if migration is None:
                        raise
                    self.fleet.upstream_failed(inst, exc)
                    broke = exc.kind
                if broke is None:
                    break
                # the stream broke: continued elsewhere, else the error event (migration.py)
                assert self.migrator is not None and migration is not None
                relay.buffer = b""
                moved = await self.migrator.resume(call, migration, inst, broke)
                if isinstance(moved, bytes):
                    yield moved if derender is None else await derender.feed(moved)
                    break
                if moved is None:
                    outcome = "decode_failed_mid_stream"
                    yield sse_error(502, f"decode instance failed mid-stream: {broke[:100]}")
                    break
                resp.close()
                resp, inst = moved.response, moved.instance
        except UpstreamError as exc:
            outcome = "decode_failed_mid_stream"
            self.fleet.upstream_failed(inst, exc)
            logger.warning(
                "request %s: decode stream from %s failed: %s", ctx.request_id, inst.label, exc
            )
            yield sse_error(502, f"decode instance failed mid-stream: {exc.kind}")
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "client_gone"
            self.metrics.aborts.labels("decode_stream").inc()
            logger.info("request %s: client disconnected while streaming", ctx.request_id)
            if ctx.tokens is not None:
                self.background.abort_engines(call)
            raise
        finally:
            resp.close()
            if derender is not None:
                derender.close()
            relay.writer = None
            via = migration.via if migration is not None else ""
            call.finish(outcome, f"{outcome} via {inst.label}{via}")
            call.close()


class StreamRelay:
    """One stream's events on their way to the client, and the timings taken from them.

    ``events`` turns the engine's bytes into complete SSE events (a trailing partial event
    waits in ``buffer`` for its end; events that arrived together leave together, fewer
    writes under load), hides ``kv_transfer_params``, reports the prefill's cache hits, and
    observes the first token and the gaps between arrivals. ``sink`` does the same from the
    upstream connection's ``data_received`` and writes the events to the client with
    ``writer`` (set by ``RelayResponse``, or by ``direct_sink`` before the response starts),
    no task woken, when it may.
    """

    __slots__ = (
        "buffer",
        "call",
        "first",
        "headers",
        "itl",
        "last",
        "migration",
        "relay",
        "writer",
    )

    def __init__(self, relay: Relay, call: Call):
        self.relay = relay
        self.call = call
        metrics = relay.metrics
        self.itl = metrics.child(metrics.itl, call.label)
        #: The stream's record for a migration (``call.migration``, made before this).
        self.migration = call.migration
        self.headers = [
            (b"content-type", b"text/event-stream"),
            (b"x-request-id", call.ctx.echo_id.encode("latin-1")),
        ]
        self.buffer = b""
        self.first: float | None = None
        self.last = 0.0
        self.writer: DirectWriter | None = None

    @property
    def started(self) -> bool:
        """Has the response started from the engine connection's side?"""
        writer = self.writer
        return writer is not None and writer.started

    def direct_sink(self) -> Callable[[bytes], bool] | None:
        """Text mode: the sink through which a 200 answer's first events go to the client
        from the engine connection as they come (the response started there), ahead of the
        request's task waking; None where that cannot be done."""
        if self.call.ctx.tokens is not None or not self.relay.fast_path:
            return None
        if self.writer is None:
            self.writer = DirectWriter.before_start(self.call.watch.cycle, self.headers)
        return self.sink if self.writer is not None else None

    def split(self, chunk: bytes) -> bytes | None:
        """The complete events ``chunk`` ends (None: none yet), as the engine sent them."""
        buffer = self.buffer + chunk if self.buffer else chunk
        end = buffer.rfind(b"\n\n") + 2
        if end < 2:
            self.buffer = buffer
            return None
        if end == len(buffer):
            self.buffer = b""
            return buffer
        self.buffer = buffer[end:]
        return buffer[:end]

    def events(self, chunk: bytes, now: float) -> bytes | None:
        """Text mode: the complete events ``chunk`` ends (None: none yet), as the client
        gets them; their arrival at ``now`` observed."""
        ready = self.split(chunk)
        return None if ready is None else self.shown(ready, now)

    def shown(self, ready: bytes, now: float) -> bytes | None:
        """Complete events ``ready`` as the client gets them (None: nothing of them), their
        arrival at ``now`` observed."""
        migration = self.migration
        if migration is not None:  # its record, and the token ids it asked for hidden
            ready = migration.feed(ready)
            if not ready:
                return None
        cached = self.call.cached
        if b'"kv_transfer_params"' in ready or (
            cached is not None and b'"prompt_tokens_details"' in ready
        ):
            ready = _patch_events(ready, cached)
        if self.first is None:
            self.observe(ready, now)
        else:  # ``observe``'s gap, without its call: this runs for every event
            self.itl.observe(now - self.last)
            self.last = now
        return ready

    def observe(self, ready: bytes, now: float) -> None:
        """Events going to the client at ``now``: the first token, or the gap since the
        last events."""
        if self.first is None:
            if ready.startswith(b"data: {") or b"\n\ndata: {" in ready:
                self.first = now
                self.relay.first_token(self.call, now)
        else:
            self.itl.observe(now - self.last)
        self.last = now

    def sink(self, chunk: bytes) -> bool:
        """``UpstreamResponse.set_sink``'s sink: True when ``chunk`` was taken (its events,
        if any, written to the client). The end of the stream is left to the relay task, so
        that it leaves with the end of the response in one write."""
        writer = self.writer
        if writer is None or not writer.ready():
            return False
        now = perf_counter()
        if self.buffer or not chunk.endswith(b"\n\n"):  # a partial event held, or left
            if (self.buffer + chunk if self.buffer else chunk).endswith(STREAM_END):
                return False
            ready = self.events(chunk, now)
            if ready is not None:
                writer.write(ready)
            return True
        if chunk.endswith(STREAM_END):
            return False
        # complete events, nothing held back: ``shown``, without its call (this runs for
        # every event)
        migration = self.migration
        if migration is not None:  # its record, and the token ids it asked for hidden
            chunk = migration.feed(chunk)
            if not chunk:
                return True
        cached = self.call.cached
        if b'"kv_transfer_params"' in chunk or (
            cached is not None and b'"prompt_tokens_details"' in chunk
        ):
            chunk = _patch_events(chunk, cached)
        if self.first is None:
            self.observe(chunk, now)
        else:
            self.itl.observe(now - self.last)
            self.last = now
        writer.write(chunk)
        return True


def record_transfer(metrics: ProxyMetrics, decider: Decider, call: Call, now: float) -> None:
    """A split's decode leg had its first token at ``now``: the transfer gap, for the
    metric and the cost model; the KV room it reserved is now taken on the decode."""
    call.landed()
    prefill_done = call.prefill_done
    if prefill_done is not None:
        gap = now - prefill_done
        metrics.pair(metrics.transfer_gap, call.prefill_instance, call.decode_instance).observe(gap)
        decider.observe(call.ctx.est_prompt_tokens, prefill_done - call.start, gap)


def patch_payload(data: dict[str, Any], cached: int | None) -> dict[str, Any]:
    """Hide ``kv_transfer_params`` from the client; report the prefill side's cache hits."""
    data.pop("kv_transfer_params", None)
    usage = data.get("usage")
    if cached is not None and isinstance(usage, dict):
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            details["cached_tokens"] = cached
    return data


def _patch_events(ready: bytes, cached: int | None) -> bytes:
    """Complete events with ``kv_transfer_params`` hidden and the prefill's cache hits in."""
    return b"".join(_patch_event(event, cached) + b"\n\n" for event in ready[:-2].split(b"\n\n"))


def _patch_event(event: bytes, cached: int | None) -> bytes:
    if not event.startswith(b"data: {"):
        return event
    try:
        data = jsonb.loads(event[6:])
    except ValueError:
        return event
    if not isinstance(data, dict):
        return event
    return b"data: " + json.dumps(patch_payload(data, cached)).encode()
