"""PdExtMoRIIOConnector over our ``tcp`` transport backend on two real `vllm serve`: both modes
give colocated output and load the prompt, the KV path refuses whoever lacks the fleet key, and
a peer that holds it reads no block that was not leased to it (a module of its own, so only two
engines run at once).
"""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from tests.integration.fleet_helpers import (
    FLEET_KEY,
    pdext_pair,
    split_read,
    split_write,
    wait_idle,
)
from tests.unit.transport.peer import raw_tcp_hello, raw_tcp_read
from vllm_pd_ext.connectors.common.side_channel import fetch_handshake
from vllm_pd_ext.tools.pd_demo import completion_body, make_prompt_ids, stream_completion
from vllm_pd_ext.util.prom import EXTERNAL_KV, PROMPT_TOKENS_BY_SOURCE

pytestmark = pytest.mark.integration

UNAUTHENTICATED = "vllm:pdext_kv_unauthenticated_total"
UNGRANTED = "vllm:pdext_kv_ungranted_total"


@pytest.fixture(scope="module")
def pair(vllm_servers, tiny_qwen):
    return pdext_pair(vllm_servers, tiny_qwen, "moriio-tcp", backend="tcp")


def test_over_our_tcp_backend(pair, tiny_qwen):
    """The same connector over the ``tcp`` transport backend, both modes."""
    prefill, decode, side = pair
    prompt_ids = make_prompt_ids(tiny_qwen, 300)
    with httpx.Client(timeout=httpx.Timeout(120.0, connect=5.0)) as client:
        body = completion_body(prefill, prompt_ids, 16)
        colocated, _ = stream_completion(client, prefill, body)
        before = decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV)
        assert split_read(client, prefill, decode, prompt_ids, 16) == colocated
        assert split_write(client, prefill, decode, side, prompt_ids, 16) == colocated
    assert decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV) - before >= 2 * 299
    wait_idle(prefill)


def test_the_kv_path_refuses_whoever_lacks_the_fleet_key(pair, tiny_qwen):
    """An attacker who reaches the prefill engine's side channel and data server: the
    untagged handshake is refused with nothing of the layout in the answer, a raw socket that
    cannot prove the key gets no read, write or notification through, and the prefill engine
    counts both refusals on its /metrics (shipped with the next request's step)."""
    from vllm_pd_ext.transport import tcp

    prefill, decode, side = pair
    before = prefill.metric(UNAUTHENTICATED)
    answer = httpx.get(f"http://127.0.0.1:{side}/handshake", timeout=10)
    assert answer.status_code == 401, answer.text
    assert "transport" not in answer.text and "layout" not in answer.text
    doc = fetch_handshake("127.0.0.1", side, 10.0, bytes.fromhex(FLEET_KEY))  # the fleet's
    host, _, port = doc["transport"]["address"].rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        kind, message = raw_tcp_hello(s)
        assert kind == tcp._FAIL and "no proof of the fleet key" in message
        s.settimeout(10)
        assert s.recv(1) == b"", "the data server kept the connection open"
    prompt_ids = make_prompt_ids(tiny_qwen, 120)
    with httpx.Client(timeout=httpx.Timeout(120.0, connect=5.0)) as client:
        colocated, _ = stream_completion(client, decode, completion_body(decode, prompt_ids, 8))
        assert split_read(client, prefill, decode, prompt_ids, 8) == colocated
    deadline = time.monotonic() + 60
    while prefill.metric(UNAUTHENTICATED) - before < 2:
        assert time.monotonic() < deadline, "the refusals never reached the prefill's /metrics"
        time.sleep(0.5)
    wait_idle(prefill)


def test_a_peer_with_the_fleet_key_reads_no_block_leased_to_nobody(pair, tiny_qwen):
    """A socket that holds the fleet key (it passes HELLO) asks the prefill engine's data server
    for the first bytes of a registered KV region: refused with the server's reason, counted on
    the prefill's /metrics; splits keep giving colocated output."""
    from vllm_pd_ext.transport import tcp

    prefill, decode, side = pair
    before = prefill.metric(UNGRANTED)
    key = bytes.fromhex(FLEET_KEY)
    doc = fetch_handshake("127.0.0.1", side, 10.0, key)
    host, _, port = doc["transport"]["address"].rpartition(":")
    region = doc["transport"]["regions"][0][0]
    with socket.create_connection((host, int(port)), timeout=10) as s:
        assert raw_tcp_hello(s, key=key, me=b"a-fleet-peer") == (tcp._OK, "")
        kind, message, data = raw_tcp_read(s, region, [(0, 4096)])
    assert kind == tcp._FAIL and data == b""
    assert "read outside the spans granted to a-fleet-peer" in message
    prompt_ids = make_prompt_ids(tiny_qwen, 120)
    with httpx.Client(timeout=httpx.Timeout(120.0, connect=5.0)) as client:
        colocated, _ = stream_completion(client, decode, completion_body(decode, prompt_ids, 8))
        assert split_read(client, prefill, decode, prompt_ids, 8) == colocated
    deadline = time.monotonic() + 60
    while prefill.metric(UNGRANTED) - before < 1:
        assert time.monotonic() < deadline, "the refusal never reached the prefill's /metrics"
        time.sleep(0.5)
    assert prefill.metric(UNGRANTED) - before == 1  # the splits' own reads were all granted
    assert decode.metric(UNGRANTED) == 0
    wait_idle(prefill)
