"""Backends by name: ``get_backend("mooncake", host=..., protocol="tcp")``.

Connector configs name a backend; this table maps the name to a class, imported only when
asked for so that importing the transport package pulls no engine library.
"""

from __future__ import annotations

import importlib
from typing import Any

from vllm_pd_ext.transport.base import Transport
from vllm_pd_ext.transport.errors import TransportError

#: name -> "module:Class". Extend with register_backend().
_BACKENDS: dict[str, str] = {
    "cma": "vllm_pd_ext.transport.cma:CmaTransport",
    "mooncake": "vllm_pd_ext.transport.mooncake:MooncakeTransport",
    "mori": "vllm_pd_ext.transport.mori:MoriTransport",
    "tcp": "vllm_pd_ext.transport.tcp:TcpTransport",
}


def backend_names() -> list[str]:
    """Names ``get_backend`` accepts."""
    return sorted(_BACKENDS)


def register_backend(name: str, target: str) -> None:
    """Add a backend as ``"module:Class"``; a name already taken raises ``ValueError``."""
    if name in _BACKENDS:
        raise ValueError(f"transport backend {name!r} is already registered")
    if ":" not in target:
        raise ValueError(f"backend target must look like 'module:Class', got {target!r}")
    _BACKENDS[name] = target


def backend_class(name: str) -> type[Transport]:
    """The class of backend ``name``, imported now; :class:`TransportError` for an unknown name."""
    try:
        target = _BACKENDS[name]
    except KeyError:
        raise TransportError(
            f"unknown transport backend {name!r}; known: {', '.join(backend_names())}"
        ) from None
    module_name, class_name = target.split(":", 1)
    cls: type[Transport] = getattr(importlib.import_module(module_name), class_name)
    return cls


def get_backend(name: str, **settings: Any) -> Transport:
    """Create the transport backend ``name`` with its settings (validated by its config model).

    Raises :class:`TransportError` for an unknown name, and pydantic's ``ValidationError`` for
    a bad setting (its message names the key).
    """
    return backend_class(name)(**settings)
