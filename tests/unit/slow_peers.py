"""Raw-socket attackers for tests of our listeners' connection limits: connections from a
chosen loopback address that send part of what they must, a byte at a time or not at all, and a
poll (with a deadline, no fixed sleeps) for the server closing them."""

from __future__ import annotations

import itertools
import socket
import time


def connect_from(source: str, port: int, n: int = 1, first: bytes = b"") -> list[socket.socket]:
    """``n`` connections to ``127.0.0.1:port`` from the loopback address ``source`` (any of
    127.0.0.0/8 binds on Linux), each of which sent ``first`` and then stops."""
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))
        if first:
            s.sendall(first)
        socks.append(s)
    return socks


def closed_within(sock: socket.socket, deadline_s: float, trickle: bytes = b"") -> bool:
    """Whether the server closes ``sock`` within ``deadline_s``, while it sends one byte of
    ``trickle`` every 0.1 s (as a slow client would). Bytes the server answers are skipped."""
    deadline = time.monotonic() + deadline_s
    sock.settimeout(0.1)
    for i in itertools.count():
        if time.monotonic() > deadline:
            return False
        try:
            if i < len(trickle):
                sock.sendall(trickle[i : i + 1])
            if sock.recv(4096) == b"":
                return True
        except TimeoutError:
            continue
        except (BrokenPipeError, ConnectionResetError):
            return True
    raise AssertionError("unreachable")
