"""The ``mooncake`` proxy protocol against vLLM's own MooncakeConnector code: the decode
side's bootstrap query (``MooncakeConnectorWorker._connect_to_prefiller_bootstrap``) run on
what the proxy sends, against vLLM's own bootstrap server."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx

from tests.skips import requires
from vllm_pd_ext.proxy.config import InstanceConfig
from vllm_pd_ext.proxy.protocols import make_protocol
from vllm_pd_ext.util.vllm_process import free_port


@requires("vllm", why="vLLM's MooncakeConnector and bootstrap server are the peer")
def test_vllms_decode_side_reaches_the_prefill_bootstrap_server_the_proxy_names():
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
        MooncakeConnectorWorker,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_utils import (
        MooncakeBootstrapServer,
    )

    server = MooncakeBootstrapServer("127.0.0.1", free_port())
    server.start()
    try:
        worker = {"engine_id": "eng-p", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0}
        registered = httpx.post(
            f"http://127.0.0.1:{server.port}/register",
            json={**worker, "addr": "127.0.0.1:17001"},
            timeout=30,
        )
        assert registered.status_code == 200, registered.text
        prefill = InstanceConfig(
            url="http://127.0.0.1:1",
            role="prefill",
            engine_id="eng-p",
            bootstrap_addr=f"127.0.0.1:{server.port}",
        )
        decode = InstanceConfig(url="http://127.0.0.1:2", role="decode")
        plan = make_protocol("mooncake").plan("req-1", prefill, decode)
        assert plan.decode_params is not None  # a concurrent protocol builds both legs
        addr = plan.decode_params["remote_bootstrap_addr"]

        # The decode worker's state the method reads and fills (its constructor needs a
        # whole engine: KV caches, a transfer engine).
        state = SimpleNamespace(_remote_agents={}, _tp_size={}, _pending_bootstrap_queries={})

        async def query() -> None:
            state._pending_bootstrap_queries[addr] = asyncio.Event()
            await MooncakeConnectorWorker._connect_to_prefiller_bootstrap(state, addr)

        asyncio.run(query())
    finally:
        server.shutdown()
    assert state._remote_agents == {"eng-p": {0: {0: "127.0.0.1:17001"}}}
    assert state._tp_size == {"eng-p": 1}
