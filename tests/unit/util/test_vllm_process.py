"""The vllm serve process helper, exercised on ordinary processes."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections import deque

import pytest

from tests.skips import not_applicable
from vllm_pd_ext.util import vllm_process
from vllm_pd_ext.util.vllm_process import (
    VllmServer,
    VllmServerError,
    _ephemeral_range,
    cpu_env,
    free_port,
)


def test_cpu_env_binds_core_and_sizes_cache():
    env = cpu_env(cpu_core=1, kv_cache_gib=2)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["HF_HUB_OFFLINE"] == "1"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in cpu_env()


def test_cpu_env_binds_one_core_per_tensor_parallel_rank():
    assert cpu_env(cpu_core=range(2))["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    assert cpu_env(cpu_core=[1, 0])["VLLM_CPU_OMP_THREADS_BIND"] == "1|0"


def test_free_port_is_bindable():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_free_ports_stay_out_of_the_outgoing_range_and_do_not_repeat():
    low, _ = _ephemeral_range()
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    if low > 11_000:  # Linux's default range: room below it
        assert all(p < low for p in ports)


def test_free_port_skips_a_port_in_use(monkeypatch):
    low, _ = _ephemeral_range()
    if low <= 11_000:
        not_applicable("no room below the outgoing port range")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        # the random draw offers the busy port first: it is passed over for the next ones
        others = [taken - k for k in range(1, 30)]
        offers = iter([taken, taken, *others])
        monkeypatch.setattr(vllm_process._RANDOM, "randrange", lambda a, b: next(offers))
        monkeypatch.setattr(vllm_process, "_HANDED_OUT", deque(maxlen=8))
        port = free_port()
    assert port in others


def _server(tmp_path, argv) -> VllmServer:
    log = tmp_path / "proc.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return VllmServer(model="m", port=free_port(), proc=proc, log_path=log, served_name="m")


def test_stop_kills_the_whole_process_group(tmp_path):
    pid_file = tmp_path / "child.pid"
    code = (
        "import subprocess, sys, time\n"
        f"c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(c.pid))\n"
        "time.sleep(600)\n"
    )
    server = _server(tmp_path, [sys.executable, "-c", code])
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = int(pid_file.read_text())
    server.stop(grace=5)
    assert not server.alive()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the grandchild outlived stop()")


def test_wait_healthy_reports_early_exit_with_log(tmp_path):
    server = _server(
        tmp_path, [sys.executable, "-c", "print('boom: bad flag'); raise SystemExit(3)"]
    )
    with pytest.raises(VllmServerError, match="exited with 3") as err:
        server.wait_healthy(timeout=30)
    assert "boom: bad flag" in str(err.value)


def test_wait_healthy_times_out(tmp_path):
    server = _server(tmp_path, [sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(VllmServerError, match="not healthy"):
            server.wait_healthy(timeout=1)
    finally:
        server.stop(grace=2)


def test_children_die_with_a_killed_parent(tmp_path):
    """A supervisor killed outright (SIGKILL) leaves no orphans: PDEATHSIG reaches the child."""
    pid_file = tmp_path / "child.pid"
    code = (
        "import subprocess, sys, time\n"
        "from vllm_pd_ext.util.vllm_process import die_with_parent_preexec\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'],\n"
        "                     start_new_session=True, preexec_fn=die_with_parent_preexec)\n"
        f"open({str(pid_file)!r}, 'w').write(str(c.pid))\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = int(pid_file.read_text())
    parent.kill()
    parent.wait(timeout=10)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        with contextlib.suppress(ChildProcessError):
            os.waitpid(child, os.WNOHANG)  # reaped by init normally; harmless otherwise
        time.sleep(0.05)
    os.kill(child, 9)
    pytest.fail("the child outlived its killed parent")
