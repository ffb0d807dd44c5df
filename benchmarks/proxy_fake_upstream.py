"""A no-compute OpenAI-style upstream for ``proxy_overhead.py --upstream fake``.

A bare ASGI app (no framework, so its own cost stays small and constant) served by uvicorn in
its own process. ``POST /v1/completions`` and ``/v1/chat/completions`` answer ``max_tokens``
tokens in vLLM's wire format, streamed (one SSE event per token, then ``data: [DONE]``) or as
one JSON body; ``--token-interval-ms`` sleeps between streamed tokens so each token leaves as
its own chunk, as it does from a real engine. ``/health``, ``/v1/models`` and a ``/metrics``
with the gauges routers scrape are served too.

Run: ``python benchmarks/proxy_fake_upstream.py --port 8100 [--token-interval-ms 1]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

MODEL = "fake"

METRICS = (
    b"# TYPE vllm:num_requests_running gauge\n"
    b'vllm:num_requests_running{engine="0",model_name="fake"} 0\n'
    b"# TYPE vllm:num_requests_waiting gauge\n"
    b'vllm:num_requests_waiting{engine="0",model_name="fake"} 0\n'
    b"# TYPE vllm:kv_cache_usage_perc gauge\n"
    b'vllm:kv_cache_usage_perc{engine="0",model_name="fake"} 0\n'
)
MODELS = json.dumps(
    {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "bench"}]}
).encode()


def _headers(content_type: bytes) -> list[tuple[bytes, bytes]]:
    return [(b"content-type", content_type)]


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class FakeEngine:
    """The ASGI app. ``token_interval_s`` is the pause between streamed tokens."""

    def __init__(self, token_interval_s: float):
        self.token_interval_s = token_interval_s
        self.counter = 0

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if method == "GET" and path in ("/health", "/ping"):
            await self._plain(send, 200, b"", b"text/plain")
        elif method == "GET" and path == "/metrics":
            await self._plain(send, 200, METRICS, b"text/plain; version=0.0.4")
        elif method == "GET" and path == "/v1/models":
            await self._plain(send, 200, MODELS, b"application/json")
        elif method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            body = await _read(receive)
            await self._complete(
                send, json.loads(body or b"{}"), chat=path.endswith("chat/completions")
            )
        else:
            await self._plain(send, 404, b'{"error":{"message":"not found"}}', b"application/json")

    @staticmethod
    async def _plain(send: Any, status: int, body: bytes, content_type: bytes) -> None:
        await send(
            {"type": "http.response.start", "status": status, "headers": _headers(content_type)}
        )
        await send({"type": "http.response.body", "body": body})

    async def _complete(self, send: Any, body: dict[str, Any], chat: bool) -> None:
        self.counter += 1
        rid = f"{'chatcmpl' if chat else 'cmpl'}-fake{self.counter}"
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        if not body.get("stream"):
            text = "".join(f" t{i}" for i in range(n))
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            payload = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": MODEL,
                "choices": [choice],
                "usage": {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n},
            }
            await self._plain(send, 200, json.dumps(payload).encode(), b"application/json")
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": _headers(b"text/event-stream; charset=utf-8"),
            }
        )
        obj_chunk = "chat.completion.chunk" if chat else "text_completion"
        for i in range(n):
            if i and self.token_interval_s > 0:
                await asyncio.sleep(self.token_interval_s)
            last = i == n - 1
            if chat:
                choice = {"index": 0, "delta": {"content": f" t{i}"}}
            else:
                choice = {"index": 0, "text": f" t{i}", "logprobs": None}
            choice["finish_reason"] = "length" if last else None
            event = _event(
                {
                    "id": rid,
                    "object": obj_chunk,
                    "created": created,
                    "model": MODEL,
                    "choices": [choice],
                }
            )
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


async def _read(receive: Any) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token-interval-ms", type=float, default=1.0)
    args = parser.parse_args(argv)
    uvicorn.run(
        FakeEngine(args.token_interval_ms / 1000.0),
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        lifespan="on",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
