"""Transport factories the contract tests run in both processes, by backend name."""

from __future__ import annotations

from vllm_pd_ext.transport import Transport, backend_names, get_backend

#: Backends the contract suite runs over: every registered one (each needs a factory below).
BACKENDS = backend_names()


def make_transport(name: str) -> Transport:
    """A transport of backend ``name`` on 127.0.0.1 (mori through the fake engine)."""
    if name == "mooncake":
        return get_backend("mooncake", host="127.0.0.1", protocol="tcp")
    if name == "mori":
        from tests.unit.transport import fake_mori

        return get_backend("mori", host="127.0.0.1", backend="rdma", module=fake_mori)
    if name == "tcp":
        return get_backend("tcp", host="127.0.0.1")
    if name == "cma":
        return get_backend("cma", host="127.0.0.1")
    raise ValueError(name)
