"""Clear failure for connectors that are registered but not built yet."""

from __future__ import annotations

from vllm_pd_ext import __version__


class ConnectorNotImplementedError(NotImplementedError):
    """Raised when vLLM constructs a connector whose implementation has not landed."""


def not_implemented(name: str, issue: int) -> ConnectorNotImplementedError:
    """The error a placeholder connector raises at construction, naming its tracking issue."""
    return ConnectorNotImplementedError(
        f"{name} is registered but not implemented yet in vllm-pd-ext {__version__} "
        f"(tracking issue #{issue}). Use a built-in vLLM connector such as NixlConnector "
        f"until it lands."
    )
