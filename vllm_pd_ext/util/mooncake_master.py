"""Start a local ``mooncake_master`` (Mooncake Store's master) for the tiered cache's remote
tier: bound to 127.0.0.1, on free ports, stopped with the context.

``mooncake_master`` binds every address by default and has no authentication; this starts its
RPC and metrics servers on loopback only, without its HTTP metadata server (whose host flag
this build ignores: it binds every address): the store's clients exchange their transfer
metadata peer to peer (``P2PHANDSHAKE``). A fleet on several hosts runs its own master on a
private network instead (docs/tiered-cache.md).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from vllm_pd_ext.util.vllm_process import free_port

HOST = "127.0.0.1"


@dataclass(frozen=True)
class Master:
    """A running master: what a ``remote:`` tier config needs to reach it."""

    rpc_port: int

    @property
    def master(self) -> str:
        return f"{HOST}:{self.rpc_port}"


def master_binary() -> str | None:
    """``mooncake_master`` beside this Python (a venv's bin/), else on PATH; None if neither."""
    here = Path(sys.executable).with_name("mooncake_master")
    return str(here) if here.is_file() else shutil.which("mooncake_master")


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((HOST, port)) == 0


@contextmanager
def mooncake_master(
    log: Path | None = None, timeout_s: float = 30.0, rpc_port: int | None = None
) -> Iterator[Master]:
    """A ``mooncake_master`` on loopback (``rpc_port``, else a free port) for as long as the
    context; ``RuntimeError`` when the binary is missing or it does not listen within
    ``timeout_s``."""
    exe = master_binary()
    if exe is None:
        raise RuntimeError("mooncake_master not found (pip install mooncake-transfer-engine)")
    m = Master(rpc_port or free_port(HOST))
    args = [
        exe,
        f"-rpc_address={HOST}",
        f"-rpc_port={m.rpc_port}",
        f"-metrics_host={HOST}",
        f"-metrics_port={free_port(HOST)}",
        "-enable_metric_reporting=false",
    ]
    out = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout_s
        while not _listening(m.rpc_port):
            if proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {proc.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"mooncake_master not listening after {timeout_s:.0f} s")
            time.sleep(0.05)
        yield m
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if log is not None:
            out.close()  # type: ignore[union-attr]
