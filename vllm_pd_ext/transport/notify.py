"""A tiny TCP notification channel for backends whose engine carries no messages (MoRI-IO).

Each transport runs one :class:`NotifyServer` (a listening socket and one daemon thread) and
advertises its ``host:port`` in its descriptor. :func:`send_notification` opens a connection,
sends one frame and waits for a one-byte acknowledgement, so a returned call means the peer
has queued the message. Frames: ``u32 sender length, sender (UTF-8), u32 payload length,
payload, u64 timestamp (unix ms), 16-byte nonce, 32-byte tag``; payloads are capped at
``max_payload_bytes``, sender names at ``max_sender_bytes`` (:class:`NotifyLimits`), and at
most :data:`MAX_QUEUED_NOTIFICATIONS` wait to be drained (more get no ack).

With a fleet key (:mod:`vllm_pd_ext.fleet_key`) the tag is the HMAC under it of the sender,
payload, timestamp and nonce; a server with the key queues only frames whose tag is valid, whose
timestamp is within ``MAX_SKEW_S`` and whose nonce is new, and acknowledges nothing else.
Without a key the tag is zeros and nothing is checked.

Connections are served at once, a thread each, and nobody can hold them
(:class:`~vllm_pd_ext.util.conn_slots.ConnectionSlots`), within :class:`NotifyLimits`: at most
``max_connections``, ``max_per_source`` of them from one address; a frame must have arrived
``frame_timeout_s`` after its connection opened, and when all are taken the oldest connection
still sending its frame is closed for a new one. A slow sender delays nobody else.
"""

from __future__ import annotations

import collections
import hmac
import logging
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, Field

from vllm_pd_ext import fleet_key
from vllm_pd_ext.transport.base import MAX_QUEUED_NOTIFICATIONS, Notification
from vllm_pd_ext.transport.errors import TransferError, TransferTimeout
from vllm_pd_ext.util.conn_slots import ConnectionSlots
from vllm_pd_ext.util.throttle import Throttle

logger = logging.getLogger(__name__)

_LEN = struct.Struct("!I")
_AUTH = struct.Struct("!Q16s32s")  # timestamp (unix ms), nonce, tag
_ACK = b"\x06"
#: Refused notifications and dropped frames are logged at most this often.
_WARN_EVERY_S = 10.0


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed the notification connection")
        buf += chunk
    return bytes(buf)


def _tag(key: bytes, sender: bytes, payload: bytes, stamp: int, nonce: bytes) -> bytes:
    return fleet_key.tag(key, "notification", sender, payload, str(stamp), nonce)


class _Refused(ValueError):
    """A frame without a valid fleet-key tag."""


class NotifyLimits(BaseModel):
    """What one notification server serves at most (see the module's docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_connections: int = Field(
        64,
        ge=1,
        description="Connections served at once (a thread each); beyond it, the oldest one "
        "still sending its frame is closed for a new one, or the new one is.",
    )
    max_per_source: int = Field(
        32, ge=1, description="Connections from one address at once; more from it are closed."
    )
    frame_timeout_s: float = Field(
        5.0,
        gt=0,
        description="A connection's whole frame must have arrived this long after it opened.",
    )
    max_payload_bytes: int = Field(
        64 << 10, ge=1, description="Largest notification payload, sent or received."
    )
    max_sender_bytes: int = Field(1024, ge=1, description="Longest sender name a frame may carry.")


#: The limits of a server or sender given none.
DEFAULT_LIMITS = NotifyLimits()


class NotifyServer:
    """Receives notifications on ``host:port`` (port 0 picks a free one) into a queue; with
    ``key``, only frames tagged under it (``on_refused`` is called for each other one).
    Serves connections within ``limits`` (see the module's docstring)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        key: bytes | None = None,
        on_refused: Callable[[], None] | None = None,
        limits: NotifyLimits = DEFAULT_LIMITS,
    ) -> None:
        self._key, self._on_refused = key, on_refused
        self.limits = limits
        self._replays = fleet_key.ReplayGuard()
        self._refusals = Throttle(_WARN_EVERY_S)
        self._drops = Throttle(_WARN_EVERY_S)
        #: Who may hold a connection (refusals and closes are counted there).
        self.slots = ConnectionSlots(
            "MoRI notification server",
            limits.max_connections,
            limits.max_per_source,
            limits.frame_timeout_s,
        )
        self._sock = socket.create_server((host, port))
        self._sock.settimeout(None)
        self.host = host
        self.port = int(self._sock.getsockname()[1])
        self._queue: collections.deque[Notification] = collections.deque()
        self._queue_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._serve, name=f"pdext-notify-{self.port}", daemon=True
        )
        self._thread.start()

    @property
    def address(self) -> str:
        """``host:port`` to put in the descriptor."""
        return f"{self.host}:{self.port}"

    def _serve(self) -> None:
        """Accept loop: admit each connection to a thread of its own; close late ones."""
        poll_s = min(0.2, self.limits.frame_timeout_s / 4)
        while not self._stop.is_set():
            self.slots.expire()
            try:
                ready, _, _ = select.select([self._sock], [], [], poll_s)
            except (OSError, ValueError):
                return  # socket closed
            if not ready:
                continue
            try:
                conn, source = self._sock.accept()
            except OSError:
                return
            if not self.slots.admit(conn, source[0]):
                conn.close()
                continue
            try:
                threading.Thread(
                    target=self._serve_one, args=(conn,), name="pdext-notify-conn", daemon=True
                ).start()
            except BaseException:
                self.slots.release(conn)
                conn.close()
                raise

    def _serve_one(self, conn: socket.socket) -> None:
        """Connection thread: read one frame, queue it and acknowledge it if it may be."""
        with conn:
            try:
                # A backstop per read; the frame's deadline is the slots' (expire() above).
                limits = self.limits
                conn.settimeout(limits.frame_timeout_s)
                (n,) = _LEN.unpack(_recv_exact(conn, _LEN.size))
                if n > limits.max_sender_bytes:
                    raise ValueError(f"sender name of {n} bytes exceeds {limits.max_sender_bytes}")
                name = _recv_exact(conn, n)
                (m,) = _LEN.unpack(_recv_exact(conn, _LEN.size))
                if m > limits.max_payload_bytes:
                    raise ValueError(
                        f"notification of {m} bytes exceeds {limits.max_payload_bytes}"
                    )
                payload = _recv_exact(conn, m)
                auth = _AUTH.unpack(_recv_exact(conn, _AUTH.size))
                if not self.slots.head_done(conn):
                    raise ConnectionError("closed: the frame came too late")
                self._authenticate(name, payload, *auth)
                note = Notification(sender=name.decode(), payload=payload)
                with self._queue_lock:
                    if len(self._queue) >= MAX_QUEUED_NOTIFICATIONS:
                        raise ValueError("too many notifications waiting")  # no ack: an error
                    self._queue.append(note)
                conn.sendall(_ACK)
            except _Refused as e:
                if self._on_refused is not None:
                    self._on_refused()
                if self._refusals.ready():  # a flood floods no log
                    logger.warning("refused a notification: %s", e)
            except (OSError, ValueError, UnicodeDecodeError) as e:
                if self._drops.ready():
                    logger.warning("dropped a bad notification frame: %s", e)
            finally:
                self.slots.release(conn)

    def _authenticate(
        self, sender: bytes, payload: bytes, stamp: int, nonce: bytes, tag: bytes
    ) -> None:
        if self._key is None:
            return
        if not hmac.compare_digest(tag, _tag(self._key, sender, payload, stamp, nonce)):
            raise _Refused("no valid fleet-key tag (is the sender given the fleet key?)")
        problem = self._replays.check(stamp / 1000, nonce.hex())
        if problem is not None:
            raise _Refused(problem)

    def drain(self) -> list[Notification]:
        """Notifications received since the last call, oldest first."""
        with self._queue_lock:
            out = list(self._queue)
            self._queue.clear()
        return out

    def close(self) -> None:
        """Stop accepting and join the thread (bounded)."""
        self._stop.set()
        try:
            self._sock.close()
        finally:
            self._thread.join(timeout=2.0)


def send_notification(
    address: str,
    sender: str,
    payload: bytes,
    timeout: float,
    key: bytes | None = None,
    max_payload_bytes: int = DEFAULT_LIMITS.max_payload_bytes,
) -> None:
    """Deliver one notification to the server at ``address`` and wait for its ack; with
    ``key``, tagged under it.

    Raises :class:`TransferTimeout` past ``timeout`` and :class:`TransferError` when the
    server cannot be reached, the payload is over ``max_payload_bytes``, or the server
    refused it.
    """
    if len(payload) > max_payload_bytes:
        raise TransferError(f"notification of {len(payload)} bytes exceeds {max_payload_bytes}")
    host, _, port = address.rpartition(":")
    name = sender.encode()
    stamp, nonce = int(time.time() * 1000), secrets.token_bytes(16)
    tag = _tag(key, name, payload, stamp, nonce) if key is not None else bytes(32)
    frame = (
        _LEN.pack(len(name)) + name + _LEN.pack(len(payload)) + payload
        + _AUTH.pack(stamp, nonce, tag)
    )  # fmt: skip
    try:
        with socket.create_connection((host, int(port)), timeout=max(timeout, 1e-3)) as s:
            s.sendall(frame)
            if _recv_exact(s, 1) != _ACK:
                raise TransferError(f"notification to {address} was not acknowledged")
    except TimeoutError as e:
        raise TransferTimeout(f"notification to {address} timed out after {timeout:.3f}s") from e
    except (OSError, ConnectionError) as e:
        raise TransferError(f"notification to {address} failed: {e}") from e
