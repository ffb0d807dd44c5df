"""The transport layer's exception tree.

Every error a transport raises derives from :class:`TransportError`, so a connector can catch
one type at its boundary and turn it into a load error or a released block.

```
TransportError
├── TransportClosed         the transport was closed; no further calls are allowed
├── RegistrationError       a region could not be registered (duplicate name, bad tensor, engine)
│   └── UnknownRegion       no local region is registered under that name
├── RegionBoundsError       a span leaves its registered region, or spans overlap at the target
├── GrantError              a grant could not be recorded (bad spans, unknown region, too many)
├── PeerError
│   ├── UnknownPeer         no peer connected under that id
│   ├── PeerMismatch        the descriptor belongs to another backend, or lacks a named region
│   └── PeerUnreachable     the peer's engine did not answer
└── TransferError           a submitted transfer failed (the engine said so)
    └── TransferTimeout     a wait ran out before the transfer finished (it may still finish)
```
"""

from __future__ import annotations


class TransportError(Exception):
    """Base class of every error the transport layer raises."""


class TransportClosed(TransportError):
    """The transport was closed; its engine and registrations are gone."""


class RegistrationError(TransportError):
    """A memory region could not be registered or unregistered."""


class UnknownRegion(RegistrationError, KeyError):
    """No local region is registered under the given name."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown region"


class RegionBoundsError(TransportError, ValueError):
    """A span is empty, negative, leaves its registered region, or overlaps another at the target.

    Raised before anything reaches the engine: nothing was transferred.
    """


class GrantError(TransportError, ValueError):
    """A grant (:meth:`Transport.grant`) could not be recorded: a span leaves its region, the
    region is not registered, or the transport holds as many grants as it may."""


class PeerError(TransportError):
    """A problem with the remote side of a transfer."""


class UnknownPeer(PeerError, KeyError):
    """No peer is connected under the given id (never connected, or disconnected)."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "unknown peer"


class PeerMismatch(PeerError):
    """A peer descriptor cannot be used here: another backend, or a region it lacks."""


class PeerUnreachable(PeerError):
    """The peer's engine could not be reached."""


class TransferError(TransportError):
    """A transfer failed; the destination bytes are undefined."""


class TransferTimeout(TransferError, TimeoutError):
    """A wait ran out before the transfer finished.

    The transfer may still complete later: poll the handle again, or treat its destination as
    undefined and release it only after the engine can no longer touch it.
    """
