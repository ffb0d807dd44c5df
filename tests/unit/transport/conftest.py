"""Fixtures for the transport contract suite: a peer process and a local transport per backend.

Each backend gets one peer process per test module (spawning costs about a second); every
test gets a fresh local transport connected to it both ways.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from tests.skips import need
from tests.unit.transport.backends import BACKENDS, make_transport
from tests.unit.transport.peer import PeerProcess, pattern
from vllm_pd_ext.transport import Transport

#: Size of the "kv" region each side registers.
REGION = 4 << 20
PEER_SEED, LOCAL_SEED = 1, 2


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "mooncake":
        need("mooncake", why="mooncake-transfer-engine(-non-cuda) is the backend under test")
    return request.param


@dataclass
class Remote:
    proc: PeerProcess
    descriptor: bytes


@pytest.fixture(scope="module")
def remote(backend: str) -> Iterator[Remote]:
    proc = PeerProcess(backend)
    try:
        desc = proc.call("register", "kv", REGION, PEER_SEED)
        yield Remote(proc, desc)
    finally:
        proc.stop()


@dataclass
class Local:
    transport: Transport
    buf: np.ndarray
    peer: str


@pytest.fixture
def local(backend: str, remote: Remote) -> Iterator[Local]:
    """A fresh local transport with a "kv" region, connected to the peer and back."""
    remote.proc.call("fill", "kv", PEER_SEED)
    transport = make_transport(backend)
    buf = pattern(LOCAL_SEED, REGION)
    transport.register_buffer("kv", buf.ctypes.data, buf.nbytes, owner=buf)
    try:
        peer = transport.connect(remote.descriptor)
        remote.proc.call("connect", transport.descriptor().to_bytes())
        yield Local(transport, buf, peer)
    finally:
        transport.close()
