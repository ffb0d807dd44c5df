"""Grants: with ``enforce_grants()`` on, the ``tcp`` data server serves a peer only the spans
granted to it for that operation, even a peer that holds the fleet key; the grant table's
checks agree with a byte-by-byte model; backends that cannot check say so."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import numpy as np
import pytest

from tests.unit.transport.backends import make_transport
from tests.unit.transport.peer import pattern, raw_tcp_hello, raw_tcp_read, raw_tcp_write
from vllm_pd_ext.transport import TransferError, TransferOp, Transport, backend_class, get_backend
from vllm_pd_ext.transport.errors import GrantError
from vllm_pd_ext.transport.grants import GrantTable, merge_extents

KEY = bytes(range(32))
BLOCK = 4096
REGION = 16 * BLOCK
WAIT_S = 30.0
READ, WRITE = TransferOp.READ, TransferOp.WRITE


@pytest.fixture
def server() -> Iterator[tuple[Transport, np.ndarray, list[int]]]:
    """A keyed tcp transport enforcing grants, with region "kv" (pattern 3); the list
    collects its refusal callbacks."""
    refused: list[int] = []
    t = get_backend("tcp", host="127.0.0.1", key=KEY)
    t.enforce_grants(on_refused=lambda: refused.append(1))
    buf = pattern(3, REGION)
    t.register_buffer("kv", buf.ctypes.data, buf.nbytes, owner=buf)
    try:
        yield t, buf, refused
    finally:
        t.close()


@contextlib.contextmanager
def raw_client(t: Transport, me: bytes = b"x") -> Iterator[socket.socket]:
    """A raw socket that holds the fleet key and passed HELLO as engine ``me``."""
    from vllm_pd_ext.transport import tcp

    port = int(t.descriptor().address.rpartition(":")[2])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        assert raw_tcp_hello(s, key=KEY, me=me) == (tcp._OK, "")
        yield s


def raw_read(s: socket.socket, spans, xid: int = 1) -> tuple[int, str, bytes]:
    return raw_tcp_read(s, "kv", spans, xid)


def raw_write(s: socket.socket, spans, fill: int, xid: int = 1) -> tuple[int, str]:
    return raw_tcp_write(s, "kv", spans, fill, xid)


def test_a_keyed_peer_reads_only_inside_its_read_grant(server, caplog) -> None:
    """Blocks 1 and 3 granted to "x": reads inside them are served; a read that starts,
    ends or runs through anything else is refused with the FAIL frame, counted each time,
    logged once, and the connection keeps serving."""
    from vllm_pd_ext.transport import tcp

    t, buf, refused = server
    t.grant("r", READ, "x", {"kv": [(BLOCK, BLOCK), (3 * BLOCK, BLOCK)]})
    with raw_client(t) as s, caplog.at_level("WARNING", logger="vllm_pd_ext.transport.base"):
        kind, _, data = raw_read(s, [(BLOCK, BLOCK)])
        assert kind == tcp._DATA and data == buf[BLOCK : 2 * BLOCK].tobytes()
        outside = [
            [(0, 64)],  # an ungranted block
            [(2 * BLOCK - 8, 16)],  # runs past the end of block 1
            [(2 * BLOCK, BLOCK)],  # the gap between the granted blocks
            [(BLOCK, 3 * BLOCK)],  # through the gap
            [(BLOCK, 64), (15 * BLOCK, 64)],  # one span granted, one not
        ]
        for xid, spans in enumerate(outside, start=2):
            kind, message, data = raw_read(s, spans, xid)
            assert kind == tcp._FAIL and data == b"", spans
            assert "read outside the spans granted to x" in message
        kind, _, data = raw_read(s, [(BLOCK + 8, 8), (3 * BLOCK + 100, 200)], xid=99)
        assert kind == tcp._DATA
        want = np.r_[buf[BLOCK + 8 : BLOCK + 16], buf[3 * BLOCK + 100 : 3 * BLOCK + 300]]
        assert data == want.tobytes()
    assert refused == [1] * len(outside)
    assert t.stats.totals().ungranted == len(outside)
    lines = [r for r in caplog.records if "outside what was granted" in r.getMessage()]
    assert len(lines) == 1


def test_blocks_granted_to_another_peer_or_for_writing_are_not_readable(server) -> None:
    """Block 1 is leased to "decode-a" and block 2 offered to "x" for writing: "x" reads
    neither, while "decode-a" reads its block."""
    from vllm_pd_ext.transport import tcp

    t, buf, refused = server
    t.grant("lease", READ, "decode-a", {"kv": [(BLOCK, BLOCK)]})
    t.grant("offer", WRITE, "x", {"kv": [(2 * BLOCK, BLOCK)]})
    with raw_client(t, b"x") as s:
        assert raw_read(s, [(BLOCK, BLOCK)])[0] == tcp._FAIL
        assert raw_read(s, [(2 * BLOCK, BLOCK)], xid=2)[0] == tcp._FAIL
    with raw_client(t, b"decode-a") as s:
        kind, _, data = raw_read(s, [(BLOCK, BLOCK)])
        assert kind == tcp._DATA and data == buf[BLOCK : 2 * BLOCK].tobytes()
    assert refused == [1, 1]


def test_a_write_outside_the_offer_is_refused_and_changes_nothing(server) -> None:
    """Block 0 is offered to "x": a write anywhere else (or into a block granted only for
    reading) is refused after its payload is drained, the memory is unchanged, and a write
    inside the offer on the same connection lands."""
    from vllm_pd_ext.transport import tcp

    t, buf, refused = server
    t.grant("offer", WRITE, "x", {"kv": [(0, BLOCK)]})
    t.grant("lease", READ, "x", {"kv": [(BLOCK, BLOCK)]})
    before = buf.copy()
    with raw_client(t) as s:
        for xid, spans in enumerate(
            [[(BLOCK, 64)], [(BLOCK - 32, 64)], [(0, 64), (5 * BLOCK, 64)]], start=1
        ):
            kind, message = raw_write(s, spans, 0xFF, xid)
            assert kind == tcp._FAIL and "write outside the spans granted to x" in message
        assert (buf == before).all()
        assert raw_write(s, [(0, 64), (BLOCK - 64, 64)], 0xEE, xid=9) == (tcp._OK, "")
    assert (buf[:64] == 0xEE).all() and (buf[BLOCK - 64 : BLOCK] == 0xEE).all()
    assert (buf[64 : BLOCK - 64] == before[64 : BLOCK - 64]).all()
    assert (buf[BLOCK:] == before[BLOCK:]).all()
    assert refused == [1, 1, 1]


def test_a_revoked_grant_serves_nothing(server) -> None:
    from vllm_pd_ext.transport import tcp

    t, _, _ = server
    t.grant("r", READ, "x", {"kv": [(0, BLOCK)]})
    with raw_client(t) as s:
        assert raw_read(s, [(0, 64)])[0] == tcp._DATA
        assert t.revoke("r") is True
        assert raw_read(s, [(0, 64)], xid=2)[0] == tcp._FAIL
    assert t.revoke("r") is False


def test_transports_move_granted_blocks_and_fail_clearly_outside(server) -> None:
    """Through the public API: a peer's read of two adjacent granted blocks (the client
    coalesces them into one span) and its write into an offered block work; a read or write
    beyond them fails the transfer with the server's reason and writes nothing."""
    t, buf, _ = server
    client = get_backend("tcp", host="127.0.0.1", key=KEY)
    mine = np.zeros(REGION, dtype=np.uint8)
    client.register_buffer("kv", mine.ctypes.data, mine.nbytes, owner=mine)
    try:
        peer = client.connect(t.descriptor())
        t.grant("lease", READ, client.engine_id, {"kv": [(BLOCK, BLOCK), (2 * BLOCK, BLOCK)]})
        t.grant("offer", WRITE, client.engine_id, {"kv": [(8 * BLOCK, BLOCK)]})
        spans = [(0, BLOCK, BLOCK), (BLOCK, 2 * BLOCK, BLOCK)]
        h = client.read(peer, "kv", "kv", spans)
        assert h.posted_spans == 1  # coalesced across the two granted blocks
        h.wait(WAIT_S)
        assert (mine[: 2 * BLOCK] == buf[BLOCK : 3 * BLOCK]).all()
        mine[:] = 0x5A
        client.write(peer, "kv", "kv", [(0, 8 * BLOCK, BLOCK)]).wait(WAIT_S)
        assert (buf[8 * BLOCK : 9 * BLOCK] == 0x5A).all()
        before = buf.copy()
        with pytest.raises(TransferError, match="read outside the spans granted"):
            client.read(peer, "kv", "kv", [(0, 3 * BLOCK, BLOCK)]).wait(WAIT_S)
        with pytest.raises(TransferError, match="write outside the spans granted"):
            client.write(peer, "kv", "kv", [(0, 9 * BLOCK, BLOCK)]).wait(WAIT_S)
        assert (buf == before).all()
    finally:
        client.close()


def test_a_transport_that_does_not_enforce_serves_any_span() -> None:
    """Without enforce_grants (a bare transport, as in the contract suite) grants are kept
    but not checked."""
    a, b = get_backend("tcp", host="127.0.0.1"), get_backend("tcp", host="127.0.0.1")
    src, dst = pattern(4, REGION), np.zeros(BLOCK, dtype=np.uint8)
    try:
        a.register_buffer("kv", src.ctypes.data, src.nbytes, owner=src)
        b.register_buffer("kv", dst.ctypes.data, dst.nbytes, owner=dst)
        assert not a.grants_enforced
        a.grant("r", READ, b.engine_id, {"kv": [(0, 64)]})
        b.read(b.connect(a.descriptor()), "kv", "kv", [(0, 5 * BLOCK, BLOCK)]).wait(WAIT_S)
        assert (dst == src[5 * BLOCK : 6 * BLOCK]).all()
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("name", ["mooncake", "mori", "tcp"])
def test_only_backends_that_serve_peers_themselves_enforce_grants(name) -> None:
    assert backend_class(name).enforces_grants is (name == "tcp")


def test_a_backend_that_cannot_enforce_takes_grants_as_no_ops() -> None:
    t = make_transport("mori")  # MoRI's engine over the fake: peers read us one-sided
    try:
        t.enforce_grants()
        t.grant("g", READ, "anyone", {"no such region": [(0, 1)]})
        assert not t.grants_enforced and t.revoke("g") is False
    finally:
        t.close()


def test_grants_are_validated_and_capped(server, monkeypatch) -> None:
    t, _, _ = server
    with pytest.raises(GrantError, match="leaves the region"):
        t.grant("g", READ, "x", {"kv": [(REGION - 8, 16)]})
    with pytest.raises(GrantError, match="leaves the region"):  # int64 sums cannot wrap
        t.grant("g", READ, "x", {"kv": [(2**62, 2**62)]})
    with pytest.raises(GrantError, match="no local region"):
        t.grant("g", READ, "x", {"other": [(0, 16)]})
    table = GrantTable(max_grants=2)
    one = merge_extents([(0, 8)], 64)
    table.add("a", "read", "x", {"kv": one})
    table.add("b", "read", "x", {"kv": one})
    table.add("b", "read", "x", {"kv": one})  # replacing a grant takes no new place
    with pytest.raises(GrantError, match="2 grants are held already"):
        table.add("c", "read", "x", {"kv": one})
    assert table.remove("a") and len(table) == 1
    table.add("c", "read", "x", {"kv": one})


def test_checks_agree_with_a_byte_model() -> None:
    """Random grants of random spans, random requests: a request passes exactly when each
    of its spans lies in the bytes of one grant of that peer for that operation."""
    rng = np.random.default_rng(7)
    size = 2048
    for _ in range(200):
        table, masks = GrantTable(max_grants=16), []
        for g in range(int(rng.integers(0, 4))):
            count = int(rng.integers(1, 6))
            offs = rng.integers(0, size - 1, count)
            lens = np.minimum(rng.integers(1, 300, count), size - offs)
            mask = np.zeros(size, dtype=bool)
            for o, length in zip(offs, lens, strict=True):
                mask[o : o + length] = True
            masks.append(mask)
            table.add(str(g), "read", "x", {"kv": merge_extents(np.c_[offs, lens], size)})
        table.add("other", "read", "y", {"kv": merge_extents([(0, size)], size)})
        table.add("w", "write", "x", {"kv": merge_extents([(0, size)], size)})
        count = int(rng.integers(1, 4))
        offs = rng.integers(0, size - 1, count)
        req = np.c_[offs, np.minimum(rng.integers(1, 200, count), size - offs)].astype(np.int64)
        want = all(any(m[o : o + length].all() for m in masks) for o, length in req)
        assert table.allows("x", "read", "kv", req) is want, (req, masks)
