"""PdExtMoRIIOConnector over our ``cma`` transport backend on two real `vllm serve`: the tests
of ``test_moriio_tcp.py`` (both modes give colocated output and load the prompt; the KV path
refuses whoever lacks the fleet key; a key holder reads no block that was not leased to it),
with the payload copied by cross-memory attach between the two engines. A module of its own,
so only two engines run at once.
"""

from __future__ import annotations

import pytest

from tests.integration.fleet_helpers import pdext_pair
from tests.integration.test_moriio_tcp import (  # noqa: F401 - collected here over cma
    test_a_peer_with_the_fleet_key_reads_no_block_leased_to_nobody,
    test_over_our_tcp_backend,
    test_the_kv_path_refuses_whoever_lacks_the_fleet_key,
)

pytestmark = pytest.mark.integration

#: What the backend logs (a warning, the first always) when a peer's payloads go over the
#: socket instead; same-host engines of one user must never log it.
FALLBACK = ("go over the socket, not cross-memory attach", "moves payloads over the socket")


@pytest.fixture(scope="module")
def pair(vllm_servers, tiny_qwen):
    servers = pdext_pair(vllm_servers, tiny_qwen, "moriio-cma", backend="cma")
    yield servers
    for server in servers[:2]:
        log = server.log_path.read_text(errors="replace")
        assert not any(line in log for line in FALLBACK), f"{server.log_path.name} fell back"
