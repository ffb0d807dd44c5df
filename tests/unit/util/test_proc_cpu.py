"""CPU of process trees and groups over a window, read from /proc, and the local process
listening on a port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vllm_pd_ext.util.proc_cpu import (
    _schedstat_ns,
    group_cpu,
    group_cpu_s,
    is_local_host,
    listening_pid,
    process_cpu_ns,
    tree_pids,
    trees_cpu,
)
from vllm_pd_ext.util.vllm_process import free_port


def _own_cpu_s(pid: int) -> float:
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_group_cpu_adds_up_every_process_of_the_group_and_grows_while_it_polls(group):
    pid, ids = group
    parts = _own_cpu_s(pid) + _own_cpu_s(ids["child"])  # read first: the total is later
    total = group_cpu_s(pid)
    assert group_cpu(pid).method == "cpu-clock"
    assert total >= parts - 1e-9  # the same ticks, summed in another order
    deadline = time.monotonic() + 30
    while group_cpu_s(pid) < total + 0.5:
        assert time.monotonic() < deadline, (total, group_cpu_s(pid))
        time.sleep(0.1)


def test_group_cpu_of_a_sleeping_group_stays_near_zero():
    proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while not Path(f"/proc/{proc.pid}/stat").exists():
            assert time.monotonic() < deadline
        assert group_cpu_s(proc.pid) < 0.1
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert group_cpu_s(proc.pid) == 0.0  # nobody left in the group


#: Burns 0.3 s of CPU in a thread that then ends and 0.2 s in the main thread, each measured
#: by its own CPU clock, prints what the process and its main thread used, and waits.
BURNER = """
import sys, threading, time
def burn(s):
    while time.thread_time() < s:
        pass
t = threading.Thread(target=burn, args=(0.3,)); t.start(); t.join()
burn(0.2)
print(time.process_time_ns(), time.thread_time_ns(), flush=True)
time.sleep(60)
"""


def test_a_process_cpu_is_read_to_below_a_tick_ended_threads_included():
    proc = subprocess.Popen([sys.executable, "-c", BURNER], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        own, main_thread = map(int, proc.stdout.readline().split())
        read = process_cpu_ns(proc.pid)
        assert read is not None
        ns, method = read
        assert method == "cpu-clock"
        assert own <= ns < own + 200_000_000  # the same clock, read later while it sleeps
        assert own >= 500_000_000  # the ended thread's 0.3 s is in it
        assert ns % (1_000_000_000 // os.sysconf("SC_CLK_TCK")) != 0  # not whole ticks
        # the fallback: live threads only, so the ended thread's 0.3 s is missing
        live = _schedstat_ns(proc.pid)
        assert live is not None
        assert main_thread <= live < main_thread + 200_000_000
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert process_cpu_ns(proc.pid) is None


def test_a_tree_is_its_root_and_every_descendant(group):
    pid, ids = group
    assert set(tree_pids(pid)) == {pid, ids["child"]}
    assert tree_pids(ids["child"]) == [ids["child"]]


def test_the_tree_of_an_ended_process_is_empty():
    proc = subprocess.Popen(["true"])
    proc.wait(timeout=10)
    assert tree_pids(proc.pid) == []


def test_a_polling_tree_uses_cpu_and_names_its_pollers_while_a_sleeping_one_does_not(group):
    pid, ids = group
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        used = trees_cpu({"poller": pid, "sleeper": sleeper.pid}, 1.0)
    finally:
        sleeper.kill()
        sleeper.wait(timeout=10)
    # two spinners share the host's cores with everything else: each gets a fair share
    assert used["poller"].share > 0.2
    busiest = {(t.pid, t.tid) for t in used["poller"].threads[:2]}
    assert busiest == {(pid, ids["spinner"]), (ids["child"], ids["child"])}
    assert {t.name for t in used["poller"].threads[:2]} <= {"python", "python3"} | {
        Path(sys.executable).name[:15]
    }
    assert (pid, ids["waiter"]) not in {(t.pid, t.tid) for t in used["poller"].threads}
    assert used["poller"].pct == round(100 * used["poller"].share, 1)
    assert used["sleeper"].share < 0.1
    assert set(used["poller"].pids) == {pid, ids["child"]}


def test_the_listener_on_a_port_is_found_and_a_free_port_has_none():
    port = free_port()
    assert listening_pid(port) is None
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while listening_pid(port) is None:
            assert server.poll() is None
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert listening_pid(port) == server.pid
    finally:
        server.kill()
        server.wait(timeout=10)


def test_a_listener_sharing_its_socket_with_a_child_is_the_one_found():
    """A server that forks workers onto its listening socket: the parent is the process."""
    script = (
        "import os, socket, sys, time\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
        "if os.fork() == 0:\n    time.sleep(60); sys.exit(0)\n"
        "print(s.getsockname()[1], flush=True); time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        assert len(tree_pids(proc.pid)) == 2
        assert listening_pid(port) == proc.pid
    finally:
        for child in tree_pids(proc.pid)[1:]:
            os.kill(child, 9)
        proc.kill()
        proc.wait(timeout=10)


@pytest.mark.parametrize(
    ("host", "local"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("localhost", True),
        ("::1", True),
        ("[::1]", True),
        ("192.0.2.7", False),  # TEST-NET-1: no host has it
        ("engine.example.invalid", False),
    ],
)
def test_which_hosts_are_this_host(host, local):
    assert is_local_host(host) is local


def test_an_address_of_this_hosts_interfaces_is_this_host():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: it picks the outgoing interface
        except OSError:
            pytest.skip("no IPv4 route on this host")
        address = s.getsockname()[0]
    assert is_local_host(address)
