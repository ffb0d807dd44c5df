"""Connection admission: bounds per listener and per address, head deadlines, eviction."""

from __future__ import annotations

import socket

import pytest

from vllm_pd_ext.util.conn_slots import ConnectionSlots


@pytest.fixture
def pairs():
    made: list[tuple[socket.socket, socket.socket]] = []

    def make() -> tuple[socket.socket, socket.socket]:
        made.append(socket.socketpair())
        return made[-1]

    yield make
    for a, b in made:
        a.close()
        b.close()


def _is_shut(peer: socket.socket) -> bool:
    peer.settimeout(5)
    return peer.recv(1) == b""


def test_one_source_gets_at_most_its_share(pairs):
    slots = ConnectionSlots("test", limit=4, per_source=2, head_timeout_s=10)
    conns = [pairs()[0] for _ in range(3)]
    assert [slots.admit(c, "10.0.0.1") for c in conns] == [True, True, False]
    assert slots.admit(pairs()[0], "10.0.0.2")
    slots.release(conns[0])
    assert slots.admit(conns[2], "10.0.0.1")  # its share came free
    assert slots.refused == 1


def test_a_late_head_is_closed_and_its_connection_serves_nothing(pairs):
    now = [0.0]
    slots = ConnectionSlots("test", limit=4, per_source=4, head_timeout_s=3, clock=lambda: now[0])
    (late, late_peer), (prompt, _) = pairs(), pairs()
    slots.admit(late, "a")
    slots.admit(prompt, "a")
    assert slots.head_done(prompt)
    now[0] = 2.9
    assert slots.expire() == 0
    now[0] = 3.0
    assert slots.expire() == 1 and slots.expire() == 0
    assert _is_shut(late_peer)
    assert not slots.head_done(late)  # its reader must not act on a cut-short head
    assert slots.in_head() == 0 and slots.held() == 2


def test_when_full_the_oldest_connection_in_its_head_makes_room(pairs):
    slots = ConnectionSlots("test", limit=3, per_source=3, head_timeout_s=10)
    (busy, _), (old, old_peer), (young, young_peer) = pairs(), pairs(), pairs()
    for c in (busy, old, young):
        assert slots.admit(c, "a" if c is busy else "b")
    assert slots.head_done(busy)  # past its head: never evicted
    assert slots.admit(pairs()[0], "c")
    assert _is_shut(old_peer) and slots.closed == 1
    young_peer.setblocking(False)
    with pytest.raises(BlockingIOError):
        young_peer.recv(1)  # still open


def test_threads_stay_bounded_while_closed_connections_are_not_yet_released(pairs):
    """Evicted connections count until their threads release them: at most 2 x limit."""
    slots = ConnectionSlots("test", limit=2, per_source=2, head_timeout_s=10)
    admitted = [c for i in range(6) if slots.admit(c := pairs()[0], f"s{i}")]
    assert len(admitted) == 4 and slots.held() == 4 and slots.refused == 2
    slots.release(admitted[0])
    assert slots.admit(pairs()[0], "s9")


def test_when_no_connection_is_in_its_head_a_new_one_is_refused(pairs):
    slots = ConnectionSlots("test", limit=2, per_source=2, head_timeout_s=10)
    for _ in range(2):
        c = pairs()[0]
        slots.admit(c, "a")
        slots.head_done(c)
    assert not slots.admit(pairs()[0], "b")
    assert slots.refused == 1 and slots.closed == 0


def test_shutdown_all_ends_every_connection_not_yet_released(pairs):
    """A closing listener shuts down every connection it holds, in its head or past it."""
    slots = ConnectionSlots("test", limit=4, per_source=4, head_timeout_s=10)
    (head, head_peer), (served, served_peer), (gone, gone_peer) = pairs(), pairs(), pairs()
    for c in (head, served, gone):
        slots.admit(c, "a")
    slots.head_done(served)
    slots.release(gone)
    slots.shutdown_all()
    assert _is_shut(head_peer) and _is_shut(served_peer)
    gone_peer.setblocking(False)
    with pytest.raises(BlockingIOError):
        gone_peer.recv(1)  # released before: not ours to end
