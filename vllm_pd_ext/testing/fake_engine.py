"""Stand-ins for a ``vllm serve`` instance, served on 127.0.0.1 over real sockets.

Two faces of one fake engine, sharing its model list and ``/metrics`` gauges:

* :class:`FakeEngine` (the proxy tests): a FastAPI app, served by a real uvicorn server in a
  thread (:func:`start_engine`, :class:`ServerThread`), so the proxy sees real sockets and real
  disconnects. It answers completions with deterministic "tokens", keeps prefill KV "blocks"
  until a decode instance pulls them (``POST /_fake/pull``), and can be told to fail, stall or
  die mid-stream (:class:`Behavior`). It records every request and every client disconnect it
  sees. ``Behavior.connector`` names the connector it plays (default: NIXL-style). For the
  MoRI-IO and pdext protocols it checks each leg's ``kv_transfer_params`` the way the real
  connector reads them (:func:`check_params`) and records what it would have refused in
  ``param_errors``.
* :class:`BareEngine` (the proxy overhead benchmark's no-compute upstream): a bare ASGI app (no
  framework, nothing recorded) whose own cost per request stays small and constant. ``POST
  /v1/completions`` and ``/v1/chat/completions`` answer ``max_tokens`` tokens in vLLM's wire
  format, streamed (one SSE event per token, then ``data: [DONE]``) or as one JSON body; a token
  interval spaces streamed tokens so each leaves as its own chunk, as from a real engine. Run it
  in its own process: ``python -m vllm_pd_ext.testing.fake_engine --port 8100
  [--token-interval-ms 1]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from vllm_pd_ext import fleet_key
from vllm_pd_ext.transfer_params import (
    READ,
    WRITE,
    InvalidParams,
    MooncakeDecode,
    MoRIIOReadAnswer,
    MoRIIOWriteDecode,
    NixlAnswer,
    PdExtWriteDecode,
    PrefillCacheHits,
    PrefillLeg,
    keeps_for_remote,
    loads_remote,
    mode_of,
    transfer_id_of,
)
from vllm_pd_ext.util.vllm_process import free_port

#: The served model's name in ``/v1/models`` and answers.
MODEL = "fake"
MODELS = json.dumps(
    {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "vllm-pd-ext"}]}
).encode()


def metrics_text(
    running: float = 0,
    waiting: float = 0,
    kv_usage: float = 0,
    prefix_caching: bool = True,
    kv_blocks: int = 100_000,
) -> str:
    """``/metrics``: the gauges of vLLM's that routers scrape, in Prometheus text (the cache
    settings gauge as vLLM writes it, a few of its labels)."""
    labels = f'{{engine="0",model_name="{MODEL}"}}'
    return (
        "# TYPE vllm:cache_config_info gauge\n"
        f'vllm:cache_config_info{{block_size="16",cache_dtype="auto",'
        f'enable_prefix_caching="{prefix_caching}",engine="0",'
        f'num_gpu_blocks="{kv_blocks}"}} 1.0\n'
        "# TYPE vllm:num_requests_running gauge\n"
        f"vllm:num_requests_running{labels} {running}\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        f"vllm:num_requests_waiting{labels} {waiting}\n"
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f"vllm:kv_cache_usage_perc{labels} {kv_usage}\n"
    )


#: The generate route's output ids: ``gen_ids(prompt ids, n)``.
GEN_BASE, GEN_SPAN = 300, 500
#: How many of the prompt's first ids the generate route's output depends on.
GEN_PREFIX = 4


def gen_ids(prompt_ids: list[int], n: int) -> list[int]:
    """The generate route's ``n`` output ids for ``prompt_ids``: output id ``i`` is
    ``GEN_BASE + (sum of the first GEN_PREFIX prompt ids + position) % GEN_SPAN``, its
    position ``len(prompt_ids) + i``. So a continuation (a prompt of at least
    ``GEN_PREFIX`` ids plus what was generated) goes on as an uninterrupted run would."""
    seed = sum(prompt_ids[:GEN_PREFIX]) + len(prompt_ids)
    return [GEN_BASE + (seed + i) % GEN_SPAN for i in range(n)]


@dataclass
class Behavior:
    status: int = 200  # answer completions with this status (200 = normal)
    health_status: int = 200
    delay_s: float = 0.0  # before answering a completion
    token_delay_s: float = 0.0  # between streamed tokens
    die_after_tokens: int | None = None  # streaming: break the connection after N tokens
    die_once: bool = False  # die_after_tokens applies to the next stream only
    omit_kv_params: bool = False  # a prefill that forgets kv_transfer_params
    connector: str | None = None  # "moriio-read", "moriio-write", "pdext-read", "pdext-write"
    metrics_status: int = 200  # answer /metrics with this status
    not_json: bool = False  # answer a completion with 200 and a body that is not JSON
    #: a leg that loads remote KV waits this long before its first token (a stalled KV
    #: transfer): a streamed one after its head, a whole one before its answer; a disconnect
    #: meanwhile counts in ``disconnects`` (and ends the request, as vLLM aborts it)
    kv_stall_s: float = 0.0
    #: a streamed request that loads no KV and hands none on (colocated) waits this long
    #: after its head before its first token (an engine frozen after a prefill leg)
    colocated_stall_s: float = 0.0
    prefix_caching: bool = True  # what /metrics says of it (vLLM's default: on)
    kv_blocks: int = 100_000  # the KV cache's size /metrics says (16 tokens per block)


@dataclass
class FakeEngine:
    name: str
    behavior: Behavior = field(default_factory=Behavior)
    requests: list[dict] = field(default_factory=list)
    disconnects: int = 0
    held_blocks: dict[str, int] = field(default_factory=dict)  # prefill side: req -> blocks
    pulls: int = 0
    running: int = 0
    port: int = 0
    param_errors: list[str] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)  # request ids sent to abort_requests
    #: what its streams' ``id`` and ``created`` are made from (tests that tell engines'
    #: answers apart set it)
    stamp: int = 0
    #: decode side: how each wait for a transfer_id's KV ended ("ok", "gone", "timeout",
    #: "unreachable"), by transfer_id
    kv_waits: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=self.behavior.health_status)

        @app.get("/metrics")
        async def metrics() -> Response:
            if self.behavior.metrics_status != 200:
                return Response(status_code=self.behavior.metrics_status)
            behavior = self.behavior
            text = metrics_text(
                self.running,
                0,
                len(self.held_blocks) / 100,
                behavior.prefix_caching,
                behavior.kv_blocks,
            )
            return Response(text, media_type="text/plain")

        @app.get("/v1/models")
        async def models() -> Response:
            return Response(MODELS, media_type="application/json")

        @app.post("/_fake/pull")
        async def pull(request: Request) -> JSONResponse:
            body = await request.json()
            released = self.held_blocks.pop(body["remote_request_id"], None)
            self.pulls += released is not None
            return JSONResponse({"released": released is not None})

        async def complete(request: Request, chat: bool) -> Response:
            body = await request.json()
            self.requests.append(
                {"body": body, "headers": dict(request.headers), "raw": await request.body()}
            )
            b = self.behavior
            max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
            if max_tokens is not None and (body.get("min_tokens") or 0) > max_tokens:
                # vLLM's SamplingParams check, answered as its 400
                return JSONResponse(
                    {
                        "error": {
                            "message": "min_tokens must be less than or equal to "
                            f"max_tokens={max_tokens}, got {body['min_tokens']}.",
                            "type": "BadRequestError",
                            "param": None,
                            "code": 400,
                        }
                    },
                    status_code=400,
                )
            if b.delay_s:
                try:
                    await _sleep_unless_disconnected(request, b.delay_s)
                except _Disconnected:
                    self.disconnects += 1
                    return Response(status_code=499)
            if b.status != 200:
                return JSONResponse(
                    {
                        "error": {
                            "message": f"{self.name} failed",
                            "type": "X",
                            "param": None,
                            "code": b.status,
                        }
                    },
                    status_code=b.status,
                )
            if b.not_json:
                return Response(b"<html>upstream trouble</html>", media_type="text/html")
            if body.get("model") == "bad":
                return JSONResponse(
                    {
                        "error": {
                            "message": "model 'bad' does not exist",
                            "type": "NotFoundError",
                            "param": "model",
                            "code": 404,
                        }
                    },
                    status_code=404,
                )
            params = body.get("kv_transfer_params") or {}
            rid = request.headers.get("x-request-id", "r")
            if b.connector and params:
                self.param_errors.extend(check_params(b.connector, params))
            source = _kv_source(params)
            if source is not None and not source[2]:
                # NIXL style: the prefill's answer; it already holds the KV.
                async with httpx.AsyncClient() as client:
                    await client.post(
                        source[0] + "/_fake/pull", json={"remote_request_id": source[1]}
                    )
            elif source is not None:
                # By transfer_id from the prefill's side channel, once it has computed the
                # prompt (Mooncake, MoRI-IO, pdext write; MoRI-IO read after the prefill).
                base, tid, _ = source
                self.running += 1
                try:
                    outcome = await _pull_when_ready(base, tid, request)
                finally:
                    self.running -= 1
                self.disconnects += outcome == "gone"
                self.kv_waits[tid] = outcome  # after the count: tests poll it
                if outcome != "ok":
                    return JSONResponse(
                        {
                            "error": {
                                "message": "KV never arrived",
                                "type": "X",
                                "param": None,
                                "code": 500,
                            }
                        },
                        status_code=500,
                    )
            prompt = _prompt_text(body, chat)
            prompt_ids = _prompt_ids(body, prompt)
            n_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or 8
            # token i depends on its position only: a continuation (the prompt plus what
            # was generated) goes on as an uninterrupted run would
            tokens = [f"t{(len(prompt_ids) + i) % 97}" for i in range(n_tokens)]
            out_params = None
            if keeps_for_remote(params):
                self.held_blocks[transfer_id_of(params) or rid] = 4
                if b.omit_kv_params:
                    out_params = None
                elif (b.connector or "").startswith("moriio"):
                    # What MoRIIOConnector's request_finished answers.
                    out_params = MoRIIOReadAnswer(
                        remote_engine_id=self.name,
                        remote_host="127.0.0.1",
                        remote_handshake_port=self.port,
                        remote_notify_port=self.port,
                        remote_block_ids=[[1, 2, 3, 4]],
                        transfer_id=transfer_id_of(params) or "",
                    ).params()
                else:
                    out_params = {
                        **self._nixl_answer(rid, mode_of(params, "") or None),
                        **PrefillCacheHits(3).params(),
                    }
            usage = {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(tokens),
                "total_tokens": len(prompt_ids) + len(tokens),
                "prompt_tokens_details": {"cached_tokens": len(prompt.split())},
            }
            if body.get("stream"):
                stall = b.kv_stall_s if loads_remote(params) else 0.0
                if not params:
                    stall = b.colocated_stall_s
                return StreamingResponse(
                    self._stream(request, tokens, chat, body, usage, stall, prompt_ids),
                    media_type="text/event-stream",
                )
            if b.kv_stall_s and loads_remote(params):
                try:
                    await _sleep_unless_disconnected(request, b.kv_stall_s)
                except _Disconnected:
                    self.disconnects += 1
                    return Response(status_code=499)  # nobody reads it: the client is gone
            if b.die_after_tokens is not None:  # the head, part of the answer, then a break
                if b.die_once:
                    b.die_after_tokens = None
                return StreamingResponse(_broken_body(), media_type="application/json")
            choice = (
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": " ".join(tokens)},
                    "finish_reason": "length",
                }
                if chat
                else {"index": 0, "text": " ".join(tokens), "finish_reason": "length"}
            )
            return JSONResponse(
                {
                    "id": rid,
                    "object": "x",
                    "model": body.get("model"),
                    "choices": [choice],
                    "usage": usage,
                    "kv_transfer_params": out_params,
                }
            )

        @app.post("/inference/v1/abort_requests")
        async def abort(request: Request) -> Response:
            self.aborted.extend((await request.json())["request_ids"])
            return Response(status_code=200)

        @app.post("/inference/v1/generate")
        async def generate(request: Request) -> Response:
            """Token in, token out, NIXL-style P/D: output ids are a function of the prompt's."""
            body = await request.json()
            self.requests.append({"body": body, "headers": dict(request.headers)})
            b = self.behavior
            if b.status != 200:
                return JSONResponse({"error": {"message": "x", "code": b.status}}, b.status)
            rid = "generate-tokens-" + request.headers.get("x-request-id", body["request_id"])
            params = body.get("kv_transfer_params") or {}
            source = _kv_source(params)
            if source is not None and not source[2]:  # token mode: NIXL-style answers only
                async with httpx.AsyncClient() as client:
                    await client.post(
                        source[0] + "/_fake/pull", json={"remote_request_id": source[1]}
                    )
            ids = body["token_ids"]
            n = body["sampling_params"]["max_tokens"]
            out = gen_ids(ids, n)
            out_params = None
            if keeps_for_remote(params):
                self.held_blocks[rid] = 4
                out_params = self._nixl_answer(rid)
            usage = {
                "prompt_tokens": len(ids),
                "completion_tokens": n,
                "total_tokens": len(ids) + n,
            }
            if not body.get("stream"):
                choice = {"index": 0, "token_ids": out, "finish_reason": "length"}
                return JSONResponse(
                    {
                        "request_id": rid,
                        "choices": [choice],
                        "usage": usage,
                        "kv_transfer_params": out_params,
                    }
                )

            async def events():
                self.running += 1
                try:
                    for i, tok in enumerate(out):
                        if b.die_after_tokens is not None and i >= b.die_after_tokens:
                            if b.die_once:
                                b.die_after_tokens = None
                            raise RuntimeError("fake engine died mid-stream")
                        last = i == len(out) - 1
                        choice = {
                            "index": 0,
                            "token_ids": [tok],
                            "finish_reason": "length" if last else None,
                        }
                        yield f"data: {json.dumps({'request_id': rid, 'choices': [choice]})}\n\n"
                        if b.token_delay_s:
                            await asyncio.sleep(b.token_delay_s)
                    if b.die_after_tokens == len(out):  # after the last, before [DONE]
                        if b.die_once:
                            b.die_after_tokens = None
                        raise RuntimeError("fake engine died after its last token")
                    if (body.get("stream_options") or {}).get("include_usage"):
                        final = {"request_id": rid, "choices": [], "usage": usage}
                        yield f"data: {json.dumps(final)}\n\n"
                    yield "data: [DONE]\n\n"
                except asyncio.CancelledError:
                    self.disconnects += 1
                    raise
                finally:
                    self.running -= 1

            return StreamingResponse(events(), media_type="text/event-stream")

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await complete(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> Response:
            return await complete(request, chat=True)

        return app

    def _nixl_answer(self, rid: str, mode: str | None = None) -> dict[str, Any]:
        """A NIXL-style prefill answer: this engine holds 4 blocks of ``rid``."""
        return NixlAnswer(
            remote_engine_id=self.name,
            remote_request_id=rid,
            remote_host="127.0.0.1",
            remote_port=self.port,
            remote_block_ids=[[1, 2, 3, 4]],
            transfer_mode=mode,
        ).params()

    async def _stream(
        self,
        request: Request,
        tokens: list[str],
        chat: bool,
        body: dict,
        usage: dict,
        stall_s: float = 0.0,
        prompt_ids: list[int] | None = None,
    ):
        """Asked for token ids (``return_token_ids``), vLLM's stream shape: ``id``,
        ``object``, ``created`` (both from ``stamp``), ``model``, the prompt's ids in the
        first event (a chat's in its role event, as vLLM's) and each token's id."""
        self.running += 1
        ask = bool(body.get("return_token_ids"))
        head: dict[str, Any] = {}
        if ask:
            head = {
                "id": f"{'chatcmpl' if chat else 'cmpl'}-fake{self.stamp}",
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": 1_700_000_000 + self.stamp,
                "model": body.get("model"),
            }
        try:
            if stall_s:
                await asyncio.sleep(stall_s)  # the stall itself (cancelled on a disconnect)
            if chat and ask:
                role = {"role": "assistant", "content": ""}
                first = {"index": 0, "delta": role, "logprobs": None, "finish_reason": None}
                yield _sse({**head, "choices": [first], "prompt_token_ids": prompt_ids})
            for i, tok in enumerate(tokens):
                b = self.behavior
                if b.die_after_tokens is not None and i >= b.die_after_tokens:
                    if b.die_once:
                        b.die_after_tokens = None
                    raise RuntimeError("fake engine died mid-stream")
                delta: dict[str, Any] = (
                    {"delta": {"content": tok + " "}} if chat else {"text": tok + " "}
                )
                delta["logprobs"] = None
                delta["finish_reason"] = "length" if i == len(tokens) - 1 else None
                if not chat:
                    delta["prompt_token_ids"] = prompt_ids if ask and i == 0 else None
                delta["token_ids"] = [int(tok[1:])] if ask else None
                yield _sse({**head, "choices": [{"index": 0, **delta}]})
                if self.behavior.token_delay_s:
                    await asyncio.sleep(self.behavior.token_delay_s)
            if self.behavior.die_after_tokens == len(tokens):  # after the last, before [DONE]
                raise RuntimeError("fake engine died after its last token")
            if (body.get("stream_options") or {}).get("include_usage"):
                final: dict[str, Any] = {"choices": [], "usage": usage, "kv_transfer_params": None}
                yield _sse({**head, **final})
            yield "data: [DONE]\n\n"
        except asyncio.CancelledError:
            self.disconnects += 1
            raise
        finally:
            self.running -= 1


class _Disconnected(Exception):
    pass


def _port(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value < 65536


def check_params(connector: str, params: dict) -> list[str]:
    """What ``connector`` would refuse in one leg's ``kv_transfer_params``.

    MoRI-IO: the fields ``add_new_req`` and the WRITE notify path of vLLM's MoRIIOConnector
    read when the request id embeds no peer address (explicit ``remote_host`` /
    ``remote_handshake_port`` / ``remote_notify_port``), written out from its source: the
    independent check of ``transfer_params``' MoRI-IO shapes. pdext: what our
    PdExtMoRIIOConnector accepts, which is ``transfer_params``' own parsing.
    """
    errors: list[str] = []
    leg = "prefill" if keeps_for_remote(params) else "decode"
    tid = params.get("transfer_id")

    def need(cond: bool, what: str) -> None:
        if not cond:
            errors.append(f"{connector} {leg}: {what} in {params}")

    if connector.startswith("moriio"):
        need(isinstance(tid, str) and bool(tid), "transfer_id")
        peer_needed = leg == "decode" or connector == "moriio-write"
        if peer_needed:
            need("remote_engine_id" in params, "remote_engine_id key")
            need("remote_block_ids" in params, "remote_block_ids key")
            need(isinstance(params.get("remote_host"), str) and params["remote_host"], "host")
            need(_port(params.get("remote_handshake_port")), "remote_handshake_port")
            need(_port(params.get("remote_notify_port")), "remote_notify_port")
        need(params.get("do_remote_prefill") is (leg == "decode"), "do_remote_prefill")
    elif connector == "pdext-read":
        if leg == "prefill":
            want = PrefillLeg(transfer_mode=READ).params()
            need(params == want, f"exactly {want}")
        else:
            need(loads_remote(params), "the prefill's answer")
    elif connector == "pdext-write":
        try:
            if leg == "prefill":
                prefill = PrefillLeg.parse(params)
                need(prefill.transfer_mode == WRITE, "transfer_mode write")
                tid, want = prefill.transfer_id, prefill.params()
            else:
                decode = PdExtWriteDecode.check(params, None, None)
                tid, want = decode.transfer_id, decode.signed(None)
        except InvalidParams as e:
            need(False, str(e))
            return errors
        hexid = isinstance(tid, str) and len(tid) == 32 and set(tid) <= set("0123456789abcdef")
        need(hexid, "uuid4 hex transfer_id")
        # Exactly these keys and flags (and a keyed proxy's signature).
        got = {k: v for k, v in params.items() if k != fleet_key.SIGNATURE or leg == "prefill"}
        need(got == want, f"exactly {sorted(want)}")
    return errors


def _kv_source(params: dict) -> tuple[str, str, bool] | None:
    """Where a decode leg's KV is: (base URL of the prefill holding it, the id it is held
    under, whether to wait for it by ``transfer_id``), or None for a colocated leg. A NIXL
    style answer (ours on READ) names a prefill that already holds the KV; the others (Mooncake,
    MoRI-IO, ours on WRITE) name the prefill's side channel, whose KV comes once it has
    computed the prompt. Mooncake's bootstrap address is used as vLLM's connector uses it (a
    base URL the path is appended to); the others name a host and a port."""
    if not loads_remote(params):
        return None
    with contextlib.suppress(InvalidParams):
        nixl = NixlAnswer.parse(params)
        return f"http://{nixl.remote_host}:{nixl.remote_port}", nixl.remote_request_id, False
    with contextlib.suppress(InvalidParams):
        mooncake = MooncakeDecode.parse(params)
        return mooncake.remote_bootstrap_addr, mooncake.transfer_id, True
    with contextlib.suppress(InvalidParams):
        write = PdExtWriteDecode.parse(params)
        return f"http://{write.remote_host}:{write.remote_port}", write.transfer_id, True
    with contextlib.suppress(InvalidParams):
        moriio = MoRIIOWriteDecode.parse(params)  # MoRI-IO's READ answer fits it too
        return (
            f"http://{moriio.remote_host}:{moriio.remote_handshake_port}",
            moriio.transfer_id,
            True,
        )
    return None


async def _pull_when_ready(
    base: str, transfer_id: str, request: Request, timeout: float = 20.0
) -> str:
    """Poll the prefill's pull endpoint under ``base`` (a URL) until it releases
    ``transfer_id``: "ok", "gone" if the client went away (watched on the ASGI channel),
    "timeout", or "unreachable" when ``base`` is no URL an HTTP client can reach. The
    timeout is long enough that a loaded machine never turns a disconnect into "timeout"."""
    gone = asyncio.ensure_future(_disconnected(request))
    deadline = time.monotonic() + timeout
    try:
        async with httpx.AsyncClient() as client:
            while time.monotonic() < deadline and not gone.done():
                try:
                    resp = await client.post(
                        base + "/_fake/pull", json={"remote_request_id": transfer_id}
                    )
                except httpx.RequestError:
                    return "unreachable"
                if resp.json()["released"]:
                    return "ok"
                await asyncio.sleep(0.02)
        return "gone" if gone.done() else "timeout"
    finally:
        gone.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _sleep_unless_disconnected(request: Request, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if await request.is_disconnected():
            raise _Disconnected
        await asyncio.sleep(0.02)


async def _broken_body():
    yield b'{"id": "cut'
    raise RuntimeError("fake engine died mid-answer")


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


def _prompt_ids(body: dict, prompt: str) -> list[int]:
    """The prompt's token ids: a completion's own, else one per character."""
    given = body.get("prompt")
    if isinstance(given, list) and all(type(t) is int for t in given):
        return given
    return [ord(c) for c in prompt]


def _prompt_text(body: dict, chat: bool) -> str:
    if chat:
        return " ".join(str(m.get("content", "")) for m in body.get("messages", []))
    prompt = body.get("prompt", "")
    return prompt if isinstance(prompt, str) else " ".join(map(str, prompt))


class ServerThread:
    """Runs an ASGI app with uvicorn on 127.0.0.1 in a daemon thread."""

    def __init__(self, app, port: int | None = None, http=None, **options: Any):
        """``options``: more ``uvicorn.Config`` settings (limits, timeouts)."""
        self.port = port or free_port()
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            lifespan="on",
            http=http or "auto",
            **options,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server thread did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)


def start_engine(name: str) -> tuple[FakeEngine, ServerThread]:
    engine = FakeEngine(name)
    engine.port = free_port()
    thread = ServerThread(engine.app(), engine.port).__enter__()
    return engine, thread


# -- the benchmark's upstream ----------------------------------------------------------------------


#: BareEngine's ``/metrics``: an idle engine.
METRICS = metrics_text().encode()


def _headers(content_type: bytes) -> list[tuple[bytes, bytes]]:
    return [(b"content-type", content_type)]


#: The id of :class:`BareEngine`'s first generated token; the next ones count up.
FAKE_TOKEN_ID = 1000


def _word_ids(body: dict[str, Any], chat: bool) -> list[int]:
    """:class:`BareEngine`'s made-up ids for a request's prompt: a prompt of ids is its own,
    text gets a BOS and one id per word (about as many as a tokenizer gives)."""
    given = body.get("prompt")
    if isinstance(given, list) and all(type(t) is int for t in given):
        return given
    words = _prompt_text(body, chat).split()
    return [1, *(FAKE_TOKEN_ID + sum(word.encode()) % 30000 for word in words)]


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class BareEngine:
    """The benchmark's upstream, an ASGI app. ``token_interval_s`` is the pause between streamed
    tokens. Its streams are vLLM's field for field (a chat's role event first; with
    ``return_token_ids``, made-up prompt and token ids where vLLM puts them), so a proxy that
    asks for ids pays here what it pays with vLLM."""

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
        # vLLM's stream, field for field (its models dumped with ``exclude_unset``): with
        # ``return_token_ids``, the prompt's ids in the first event (a chat's role event, a
        # completion's first choice) and each event's new ids in its choice.
        ask_ids = bool(body.get("return_token_ids"))
        prompt_ids = _word_ids(body, chat) if ask_ids else None
        if chat:
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}}
            role |= {"logprobs": None, "finish_reason": None}
            head = {"id": rid, "object": obj_chunk, "created": created, "model": MODEL}
            first = head | {"choices": [role], "prompt_token_ids": prompt_ids, "prompt_text": None}
            await send({"type": "http.response.body", "body": _event(first), "more_body": True})
        for i in range(n):
            if i and self.token_interval_s > 0:
                await asyncio.sleep(self.token_interval_s)
            last = i == n - 1
            ids = [FAKE_TOKEN_ID + i] if ask_ids else None
            if chat:
                choice = {"index": 0, "delta": {"content": f" t{i}"}, "logprobs": None}
                choice["finish_reason"] = "length" if last else None
                if last:
                    choice["stop_reason"] = None
                choice["token_ids"] = ids
            else:
                choice = {"index": 0, "text": f" t{i}", "logprobs": None}
                choice["finish_reason"] = "length" if last else None
                choice["stop_reason"] = None
                choice["prompt_token_ids"] = prompt_ids if i == 0 else None
                choice["token_ids"] = ids
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
    """Serve a :class:`BareEngine` until interrupted (the benchmark runs it as a process)."""
    parser = argparse.ArgumentParser(description="Serve the no-compute fake engine (BareEngine).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token-interval-ms", type=float, default=1.0)
    args = parser.parse_args(argv)
    uvicorn.run(
        BareEngine(args.token_interval_ms / 1000.0),
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        lifespan="on",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
