"""Bounds on what peers can make a transport hold: notification frames and queues."""

from __future__ import annotations

import socket
import struct

import pytest

from tests.unit.slow_peers import closed_within, connect_from
from vllm_pd_ext.transport import TransferError, get_backend, notify, tcp
from vllm_pd_ext.transport.notify import NotifyLimits, NotifyServer, send_notification


def test_a_frame_declaring_a_huge_sender_is_dropped_unread():
    """A frame whose sender name claims 4 GiB is refused as soon as its length is read: the
    server closes the connection instead of taking the bytes that follow (16 MiB here, more
    than the sockets' buffers hold), and goes on serving."""
    server = NotifyServer()
    try:
        with (
            socket.create_connection(("127.0.0.1", server.port), timeout=10) as s,
            pytest.raises((BrokenPipeError, ConnectionResetError)),
        ):
            s.sendall(struct.pack("!I", 0xFFFFFFFF))
            for _ in range(256):
                s.sendall(b"x" * 65536)
        send_notification(server.address, "peer", b"ok", timeout=5)
        assert [n.payload for n in server.drain()] == [b"ok"]
    finally:
        server.close()


def test_notify_server_queue_is_bounded(monkeypatch):
    monkeypatch.setattr(notify, "MAX_QUEUED_NOTIFICATIONS", 3)
    server = NotifyServer()
    try:
        for i in range(3):
            send_notification(server.address, "peer", b"%d" % i, timeout=5)
        with pytest.raises(TransferError):
            send_notification(server.address, "peer", b"one too many", timeout=5)
        assert [n.payload for n in server.drain()] == [b"0", b"1", b"2"]
        send_notification(server.address, "peer", b"room again", timeout=5)
    finally:
        server.close()


def test_tcp_notification_queue_is_bounded(monkeypatch):
    """A peer that floods notifications gets errors once the receiver holds the maximum;
    draining makes room again."""
    monkeypatch.setattr(tcp, "MAX_QUEUED_NOTIFICATIONS", 3)
    receiver = get_backend("tcp", host="127.0.0.1")
    sender = get_backend("tcp", host="127.0.0.1")
    try:
        peer = sender.connect(receiver.descriptor())
        for i in range(3):
            sender.notify(peer, b"%d" % i, timeout=5)
        with pytest.raises(TransferError):
            sender.notify(peer, b"one too many", timeout=5)
        assert [n.payload for n in receiver.drain_notifications()] == [b"0", b"1", b"2"]
        sender.notify(peer, b"room again", timeout=5)
    finally:
        sender.close()
        receiver.close()


KEY = bytes(range(32))


def test_a_keyed_notify_server_queues_only_frames_tagged_with_its_key():
    """Untagged, tagged under another key, and replayed (the same frame's bytes sent again)
    frames get no ack and are not queued; each refusal is counted."""
    refused: list[int] = []
    server = NotifyServer(key=KEY, on_refused=lambda: refused.append(1))
    try:
        send_notification(server.address, "peer", b"good", timeout=5, key=KEY)
        for key in (None, bytes(32)):
            with pytest.raises(TransferError):
                send_notification(server.address, "peer", b"forged", timeout=5, key=key)
        recorded: list[bytes] = []
        real_sendall = socket.socket.sendall

        def record(sock, data, *args):  # the bytes of one valid frame, to replay them
            recorded.append(bytes(data))
            return real_sendall(sock, data, *args)

        socket.socket.sendall = record  # type: ignore[method-assign]
        try:
            send_notification(server.address, "peer", b"once", timeout=5, key=KEY)
        finally:
            socket.socket.sendall = real_sendall  # type: ignore[method-assign]
        host, _, port = server.address.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(recorded[0])
            s.settimeout(5)
            assert s.recv(1) == b""  # closed without an ack
        assert [n.payload for n in server.drain()] == [b"good", b"once"]
        assert len(refused) == 3
    finally:
        server.close()


def test_mori_transports_with_the_fleet_key_notify_and_refuse_a_keyless_sender():
    from tests.unit.transport import fake_mori

    receiver = get_backend("mori", module=fake_mori, host="127.0.0.1", key=KEY)
    keyed = get_backend("mori", module=fake_mori, host="127.0.0.1", key=KEY)
    keyless = get_backend("mori", module=fake_mori, host="127.0.0.1")
    try:
        keyed.notify(keyed.connect(receiver.descriptor()), b"done", timeout=5)
        with pytest.raises(TransferError):
            keyless.notify(keyless.connect(receiver.descriptor()), b"forged", timeout=5)
        notes = receiver.drain_notifications()
        assert [(n.sender, n.payload) for n in notes] == [(keyed.engine_id, b"done")]
    finally:
        for t in (receiver, keyed, keyless):
            t.close()


def test_a_slow_sender_holds_up_no_other_notification():
    """A sender that stops mid-frame keeps its connection: a valid notification sent meanwhile
    is still queued and acknowledged at once."""
    server = NotifyServer(key=KEY)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as slow:
            slow.sendall(struct.pack("!I", 4) + b"pe")
            send_notification(server.address, "peer", b"written", timeout=2, key=KEY)
            assert [n.payload for n in server.drain()] == [b"written"]
    finally:
        server.close()


def test_a_trickling_sender_is_closed_at_the_frame_deadline():
    """A sender that sends its frame one byte at a time, each well within the per-read
    timeout, is closed once the frame's deadline (from the connection's start) has passed."""
    server = NotifyServer(limits=NotifyLimits(frame_timeout_s=0.5))
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as slow:
            assert closed_within(slow, 10, trickle=struct.pack("!I", 1000) + b"p" * 1000)
        assert server.slots.closed == 1
        send_notification(server.address, "peer", b"ok", timeout=5)
        assert [n.payload for n in server.drain()] == [b"ok"]
    finally:
        server.close()


def test_one_address_gets_at_most_its_share_of_connections(caplog):
    """Ten slow senders from one address: ``max_per_source`` of them are served, the others
    refused (one log line for all), and a sender from another address is still served."""
    server = NotifyServer(
        limits=NotifyLimits(max_connections=4, max_per_source=2, frame_timeout_s=60)
    )
    slow = connect_from("127.0.0.2", server.port, 10)
    try:
        with caplog.at_level("WARNING"):
            send_notification(server.address, "peer", b"ok", timeout=2)
        assert [n.payload for n in server.drain()] == [b"ok"]
        assert server.slots.refused == 8
        assert len([r for r in caplog.records if "refused a connection" in r.getMessage()]) == 1
        assert all(closed_within(s, 10) for s in slow[2:])  # the refused ones
    finally:
        for s in slow:
            s.close()
        server.close()


def test_when_full_the_oldest_unfinished_frame_makes_room():
    """Slow senders from four addresses hold every connection: a valid notification is still
    delivered, and the oldest of them is closed for it."""
    server = NotifyServer(
        limits=NotifyLimits(max_connections=4, max_per_source=1, frame_timeout_s=60)
    )
    slow = [s for i in range(4) for s in connect_from(f"127.0.0.{2 + i}", server.port)]
    try:
        send_notification(server.address, "peer", b"ok", timeout=2)
        assert [n.payload for n in server.drain()] == [b"ok"]
        assert closed_within(slow[0], 10)
        assert server.slots.closed == 1 and server.slots.refused == 0
    finally:
        for s in slow:
            s.close()
        server.close()


def test_limits_set_in_the_mori_config_reach_its_notification_server():
    """``notify_limits`` in the ``mori`` backend's settings is what its notification server
    enforces: a second connection from one address is closed at once (the default admits
    32), and a payload over the configured size is refused by receiver and sender alike."""
    from tests.unit.transport import fake_mori

    limits = {"max_per_source": 1, "max_payload_bytes": 16}
    receiver = get_backend("mori", module=fake_mori, host="127.0.0.1", notify_limits=limits)
    sender = get_backend("mori", module=fake_mori, host="127.0.0.1")
    capped = get_backend("mori", module=fake_mori, host="127.0.0.1", notify_limits=limits)
    try:
        port = int(receiver.descriptor().extra["notify"].rpartition(":")[2])
        held, extra = connect_from("127.0.0.2", port, 2)
        with held, extra:
            assert closed_within(extra, 10)
        peer = sender.connect(receiver.descriptor())
        sender.notify(peer, b"x" * 16, timeout=5)
        with pytest.raises(TransferError):
            sender.notify(peer, b"x" * 17, timeout=5)  # dropped by the receiver, no ack
        with pytest.raises(TransferError, match="exceeds 16"):
            capped.notify(capped.connect(receiver.descriptor()), b"x" * 17, timeout=5)
        assert [n.payload for n in receiver.drain_notifications()] == [b"x" * 16]
    finally:
        for t in (receiver, sender, capped):
            t.close()


def test_tcp_notification_size_is_a_setting():
    """``max_notify_bytes`` bounds what a tcp data server takes and what a transport sends."""
    receiver = get_backend("tcp", host="127.0.0.1", max_notify_bytes=16)
    sender = get_backend("tcp", host="127.0.0.1")
    capped = get_backend("tcp", host="127.0.0.1", max_notify_bytes=16)
    try:
        peer = sender.connect(receiver.descriptor())
        sender.notify(peer, b"x" * 16, timeout=5)
        with pytest.raises(TransferError):
            sender.notify(peer, b"x" * 17, timeout=5)  # the receiver drops the connection
        with pytest.raises(TransferError, match="exceeds 16"):
            capped.notify(capped.connect(receiver.descriptor()), b"x" * 17, timeout=5)
        assert [n.payload for n in receiver.drain_notifications()] == [b"x" * 16]
    finally:
        for t in (receiver, sender, capped):
            t.close()
