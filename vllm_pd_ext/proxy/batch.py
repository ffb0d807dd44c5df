"""Token mode, a completion request with a list of prompts: served as vLLM serves it.

Render answers one GenerateRequest per prompt (``TokenRequest.prompts``). Such a request is
never split (``not_splittable``): every prompt goes to the same decode instance as its own
generate request (``prompt_request_id``), all sent at once and retried together on another
instance until all answer 200. The answers come back as one OpenAI response:

* whole: one derender call with every prompt's generate response (choices in prompt order);
* streamed: the prompts' streams merged as their events arrive, each through its own
  streaming derender; a choice's ``index`` becomes ``prompt * n + index`` (vLLM's numbering),
  the per-prompt usage chunks become one usage chunk with the totals, and one ``[DONE]``
  ends it all.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, Response

from vllm_pd_ext.proxy.call import Call
from vllm_pd_ext.proxy.client_channel import STREAM_END, RelayResponse
from vllm_pd_ext.proxy.decode import DecodeLeg
from vllm_pd_ext.proxy.errors import ProxyError, passthrough, sse_error
from vllm_pd_ext.proxy.fleet import Fleet, Lease
from vllm_pd_ext.proxy.relay import JSONAnswer, Opened, Relay, StreamRelay, patch_payload
from vllm_pd_ext.proxy.routing import Route, Router
from vllm_pd_ext.proxy.token_mode import DerenderStream, RenderTier, prompt_request_id
from vllm_pd_ext.proxy.upstream import UpstreamError, UpstreamResponse

logger = logging.getLogger(__name__)


class Batch:
    def __init__(self, decode: DecodeLeg, relay: Relay, router: Router, fleet: Fleet):
        self.decode = decode
        self.relay = relay
        self.router = router
        self.fleet = fleet

    async def serve(self, call: Call, route: Route, render: RenderTier) -> Response | RelayResponse:
        """Answer the request (``call.ctx.tokens`` holds more than one prompt)."""
        opened = await self._open(call, route)
        if call.ctx.stream:
            stream = StreamRelay(self.relay, call)
            return RelayResponse(
                self._events(call, opened, stream, render), call.watch, stream.headers
            )
        return await self._whole(call, opened, render)

    async def _open(self, call: Call, route: Route) -> list[Opened]:
        ctx = call.ctx
        assert ctx.tokens is not None
        prompts = ctx.tokens.prompts
        errors: list[str] = []
        for inst in self.router.candidates(ctx, route.decode_pool, "decode", route.decode):
            with Lease(inst) as lease:
                sending = asyncio.gather(
                    *(
                        self.decode.send_body(
                            call, inst, t.generate, prompt_request_id(ctx.request_id, i)
                        )
                        for i, t in enumerate(prompts)
                    ),
                    return_exceptions=True,
                )
                results = await call.watch.race(sending, "decode_wait")
                answers = [r for r in results if isinstance(r, UpstreamResponse)]
                failed = [r for r in results if not isinstance(r, UpstreamResponse)]
                if failed or any(r.status >= 500 for r in answers):
                    for r in answers:
                        r.close()
                    down = next((e for e in failed if isinstance(e, UpstreamError)), None)
                    if down is not None:
                        self.fleet.upstream_failed(inst, down)
                        errors.append(f"{inst.label}: {down.kind}")
                    elif failed:
                        raise failed[0]
                    else:
                        statuses = sorted({r.status for r in answers if r.status >= 500})
                        errors.append(f"{inst.label}: HTTP {statuses}")
                    continue
                refused = next((r for r in answers if r.status != 200), None)
                if refused is not None:
                    try:
                        raw = await call.watch.race(refused.read(), "decode")
                    except UpstreamError:
                        raw = b""
                    finally:
                        for r in answers:
                            r.close()
                    raise passthrough(refused.status, raw)
                call.hold(lease)
                return [Opened(r, inst) for r in answers]
        raise ProxyError(502, "decode failed: " + "; ".join(errors), code="decode_failed")

    async def _whole(self, call: Call, opened: list[Opened], render: RenderTier) -> JSONResponse:
        ctx = call.ctx
        assert ctx.tokens is not None
        reading = asyncio.gather(*(self.relay.read(o) for o in opened), return_exceptions=True)
        answers: list[dict[str, Any]] = []
        for answer in await call.watch.race(reading, "decode"):
            if isinstance(answer, BaseException):
                raise answer  # every leg read to its end or closed: the first failure
            answers.append(answer)
        data = await call.watch.race(
            render.derender(ctx.route, ctx.body, ctx.tokens, answers, ctx.request_id), "decode"
        )
        patch_payload(data, None)
        call.finish("ok", f"ok via {opened[0].instance.label} ({len(opened)} prompts)")
        return JSONAnswer(data, ctx.echo_id)

    async def _events(
        self, call: Call, opened: list[Opened], stream: StreamRelay, render: RenderTier
    ) -> AsyncIterator[bytes]:
        """The prompts' streams, merged as their events arrive (see the module docstring)."""
        ctx = call.ctx
        assert ctx.tokens is not None
        n = ctx.body.get("n") or 1
        usage: dict[str, int] = {}
        outcome = "ok"
        streams = [
            self._prompt_events(
                i, o.response, DerenderStream(render, ctx.route, ctx.body, t, ctx.request_id)
            )
            for i, (o, t) in enumerate(zip(opened, ctx.tokens.prompts, strict=True))
        ]
        nexts = {asyncio.ensure_future(anext(s)): s for s in streams}
        try:
            while nexts:
                done, _ = await asyncio.wait(nexts, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    source = nexts.pop(fut)
                    try:
                        index, event = fut.result()
                    except StopAsyncIteration:
                        continue
                    except UpstreamError as exc:
                        outcome = "decode_failed_mid_stream"
                        self.fleet.upstream_failed(opened[0].instance, exc)
                        yield sse_error(502, f"decode instance failed mid-stream: {exc.kind}")
                        return
                    ready = _renumber(event, index, n, usage)
                    if ready is not None:
                        stream.observe(ready, time.perf_counter())
                        yield ready
                    nexts[asyncio.ensure_future(anext(source))] = source
            if usage:
                chunk = {
                    "id": ctx.tokens.response_id,
                    "object": "text_completion",
                    "choices": [],
                    "usage": usage,
                }
                yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
            yield STREAM_END
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "client_gone"
            self.relay.metrics.aborts.labels("decode_stream").inc()
            self.relay.background.abort_engines(call)
            raise
        finally:
            for fut in nexts:
                fut.cancel()
            for s in streams:
                await s.aclose()
            for o in opened:
                o.response.close()
            call.finish(outcome, f"{outcome} via {opened[0].instance.label}")
            call.close()

    @staticmethod
    async def _prompt_events(
        index: int, resp: UpstreamResponse, derender: DerenderStream
    ) -> AsyncGenerator[tuple[int, bytes], None]:
        """Prompt ``index``'s derendered events, one at a time."""
        buffer = b""
        try:
            async for chunk in resp.chunks():
                buffer += chunk
                end = buffer.rfind(b"\n\n") + 2
                if end < 2:
                    continue
                ready, buffer = buffer[:end], buffer[end:]
                for event in (await derender.feed(ready))[:-2].split(b"\n\n"):
                    yield index, event
        finally:
            derender.close()


def _renumber(event: bytes, prompt: int, n: int, usage: dict[str, int]) -> bytes | None:
    """One prompt's derendered event as the merged stream's: choices renumbered; its usage
    added to ``usage`` (None: nothing of it goes to the client now)."""
    if event == STREAM_END[:-2]:
        return None
    if not event.startswith(b"data: {"):
        return event + b"\n\n"
    try:
        data = json.loads(event[6:])
    except ValueError:
        return event + b"\n\n"
    if not isinstance(data, dict):
        return event + b"\n\n"
    choices = data.get("choices")
    counts = data.get("usage")
    if isinstance(counts, dict) and not choices:
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            value = counts.get(key)
            if isinstance(value, int):
                usage[key] = usage.get(key, 0) + value
        return None
    for choice in choices or []:
        if isinstance(choice, dict) and isinstance(choice.get("index"), int):
            choice["index"] = prompt * n + choice["index"]
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"
