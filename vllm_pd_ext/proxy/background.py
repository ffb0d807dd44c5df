"""Work a request leaves behind when its client goes away, run in the background (bounded).

* drain: the client left between the legs of a split. The prefill instance holds the
  prompt's KV until a decode instance pulls it or its lease runs out; a one-token decode
  request with the prefill's ``kv_transfer_params`` pulls it now, so it is freed at once.
* abort (token mode): every engine the request reached is told to abort it
  (``/inference/v1/abort_requests``); closing the connection aborts it too, this also reaches
  an engine whose answer is buffered.

At most ``limit`` tasks run at once; past that, the work is skipped and counted (the
prefill's lease, or the closed connection, still frees what the engine holds).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from vllm_pd_ext.proxy.call import Call
from vllm_pd_ext.proxy.fleet import Instance
from vllm_pd_ext.proxy.legs import one_token_body
from vllm_pd_ext.proxy.metrics import ProxyMetrics
from vllm_pd_ext.proxy.token_mode import ABORT_PATH, engine_request_id, prompt_request_id
from vllm_pd_ext.proxy.upstream import Timeouts, UpstreamError

logger = logging.getLogger(__name__)


class Background:
    def __init__(
        self,
        limit: int,
        metrics: ProxyMetrics,
        drain_timeout: Timeouts,
        abort_timeout: Timeouts,
    ):
        self.limit = limit
        self.metrics = metrics
        self.drain_timeout = drain_timeout
        self.abort_timeout = abort_timeout
        self.tasks: set[asyncio.Task] = set()

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str, kind: str) -> None:
        if len(self.tasks) >= self.limit:
            coro.close()
            self.metrics.background_skipped.labels(kind).inc()
            logger.warning("%s: %d background tasks running; %s skipped", name, self.limit, kind)
            return
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def drain(self, call: Call, decode: Instance) -> None:
        """Let ``decode`` pull the abandoned prefill KV that ``call.params`` points at."""
        assert call.params is not None
        rid = call.ctx.request_id
        self._spawn(self._drain(call, decode, call.params), f"drain-{rid}", "drain")

    async def _drain(self, call: Call, decode: Instance, params: dict[str, Any]) -> None:
        ctx = call.ctx
        outcome = "ok"
        try:
            status, _ = await decode.client.fetch(
                "POST",
                ctx.path,
                self.drain_timeout,
                one_token_body(ctx, params),
                {"X-Request-Id": f"{ctx.request_id}-drain"},
            )
            if status != 200:
                outcome = f"http_{status}"
        except UpstreamError as exc:
            outcome = exc.kind
        self.metrics.drains.labels(outcome).inc()
        logger.info("request %s: drained abandoned prefill KV (%s)", ctx.request_id, outcome)

    def abort_engines(self, call: Call) -> None:
        """Token mode: tell every engine ``call`` reached to abort it."""
        ctx = call.ctx
        rid = ctx.request_id
        prompts = len(ctx.tokens.prompts) if ctx.tokens is not None else 1
        ids = [engine_request_id(prompt_request_id(rid, i)) for i in range(prompts)]
        for inst in dict.fromkeys(call.engines):
            self._spawn(self._abort(inst, rid, ids), f"abort-{rid}", "abort")

    async def _abort(self, inst: Instance, request_id: str, ids: list[str]) -> None:
        body = {"request_ids": ids}
        try:
            status, _ = await inst.client.fetch("POST", ABORT_PATH, self.abort_timeout, body)
            outcome = str(status)
        except UpstreamError as exc:
            outcome = exc.kind
        logger.info("request %s: abort sent to %s (%s)", request_id, inst.label, outcome)

    async def close(self) -> None:
        """Cancel what still runs and wait for it to end."""
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
