"""The decode leg: the request sent to a decode instance, retried elsewhere until it answers.

The leg goes to the route's decode instance first (a concurrent protocol's prefill stage has
already sent it there: ``pending``). An attempt that fails before the answer's head
(unreachable, 5xx, timeout) is retried on another decode instance, up to ``decode_retries``;
when the protocol bound the KV to the first instance (``binds_decode``), a retry elsewhere
runs colocated. A 4xx is the client's mistake and passes through. Once an engine answers 200,
its lease stays with the call until the answer is out.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from vllm_pd_ext.proxy.call import Call
from vllm_pd_ext.proxy.client_channel import ClientGone
from vllm_pd_ext.proxy.errors import ProxyError, passthrough
from vllm_pd_ext.proxy.fleet import Fleet, Instance, Lease
from vllm_pd_ext.proxy.legs import decode_body
from vllm_pd_ext.proxy.metrics import ProxyMetrics
from vllm_pd_ext.proxy.protocols import PDProtocol
from vllm_pd_ext.proxy.relay import Opened, StreamRelay
from vllm_pd_ext.proxy.routing import Route, Router
from vllm_pd_ext.proxy.upstream import Timeouts, UpstreamError, UpstreamResponse


class DecodeLeg:
    def __init__(
        self,
        protocol: PDProtocol,
        router: Router,
        fleet: Fleet,
        metrics: ProxyMetrics,
        timeout: Timeouts,
    ):
        self.protocol = protocol
        self.router = router
        self.fleet = fleet
        self.metrics = metrics
        self.timeout = timeout

    async def send(
        self,
        call: Call,
        inst: Instance,
        params: dict[str, Any] | None,
        sink: Callable[[bytes], bool] | None = None,
    ) -> UpstreamResponse:
        """Send the decode leg to ``inst``; the response with its body unread. ``sink``:
        the body's sink from the moment a 200 head arrives."""
        ctx = call.ctx
        return await self.send_body(call, inst, decode_body(ctx, params), ctx.request_id, sink)

    async def send_body(
        self,
        call: Call,
        inst: Instance,
        body: dict[str, Any] | bytes,
        request_id: str,
        sink: Callable[[bytes], bool] | None = None,
    ) -> UpstreamResponse:
        """Send ``body`` to ``inst`` on the request's engine route as ``request_id``."""
        if call.ctx.tokens is not None:
            call.engines.append(inst)
        return await inst.client.send(
            "POST",
            call.ctx.path,
            self.timeout,
            body,
            {"X-Request-Id": request_id},
            sink_on_ok=sink,
        )

    async def open(
        self,
        call: Call,
        route: Route,
        pending: asyncio.Task | None,
        stream: StreamRelay | None,
    ) -> Opened:
        """The first decode instance to answer 200. Raises ``ProxyError`` (a 4xx passed
        through; 502 when every instance tried failed) or ``ClientGone``."""
        errors: list[str] = []
        candidates = self.router.candidates(call.ctx, route.decode_pool, "decode", route.decode)
        for attempt, inst in enumerate(candidates):
            if attempt and call.params is not None and self.protocol.binds_decode:
                call.colocate()
                self.metrics.fallbacks.labels("decode_retry").inc()
            with Lease(inst) as lease:
                if attempt == 0 and pending is not None:
                    opening: Any = pending
                else:
                    sink = stream.direct_sink() if stream is not None else None
                    body = decode_body(call.ctx, call.params)
                    opening = self.send_body(call, inst, body, call.ctx.request_id, sink)
                try:
                    resp = await call.watch.race(opening, "decode_wait")
                except UpstreamError as exc:
                    self.fleet.upstream_failed(inst, exc)
                    errors.append(f"{inst.label}: {exc.kind}")
                    continue
                except ClientGone:
                    if stream is not None and stream.started:
                        # the stream was under way, from the engine connection's side
                        raise ClientGone("decode_stream") from None
                    raise
                if resp.status >= 500:
                    resp.close()
                    errors.append(f"{inst.label}: HTTP {resp.status}")
                    continue
                if resp.status != 200:
                    try:
                        raw = await call.watch.race(resp.read(), "decode")
                    except UpstreamError:
                        raw = b""
                    finally:
                        resp.close()
                    raise passthrough(resp.status, raw)
                call.hold(lease)
                return Opened(resp, inst)
        raise ProxyError(502, "decode failed: " + "; ".join(errors), code="decode_failed")
