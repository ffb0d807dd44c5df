"""Bounds on what peers can make a transport hold: notification frames and queues."""

from __future__ import annotations

import socket
import struct

import pytest

from vllm_pd_ext.transport import TransferError, get_backend, notify, tcp
from vllm_pd_ext.transport.notify import NotifyServer, send_notification


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
