"""Finding the threads that keep an idle process group busy, and lowering their priority."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vllm_pd_ext.util.busy_threads import (
    LOWEST_PRIORITY,
    busy_threads,
    calm_idle_pollers,
    group_cpu_s,
)

# A process with one thread polling without pause, one waiting, and a child process polling;
# it prints the thread ids, then runs until killed.
SCRIPT = r"""
import json, os, subprocess, sys, threading
def spin():
    while True:
        pass
def wait():
    threading.Event().wait()
ids = {}
for name, target in (("spinner", spin), ("waiter", wait)):
    t = threading.Thread(target=target, daemon=True)
    t.start()
    ids[name] = t.native_id
child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
ids["child"] = child.pid
print(json.dumps(ids), flush=True)
threading.Event().wait()
"""


def _nice(pid: int, tid: int) -> int:
    text = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
    return int(text[text.rindex(")") + 2 :].split()[16])


@pytest.fixture
def group():
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert proc.stdout is not None
        yield proc.pid, json.loads(proc.stdout.readline())
    finally:
        os.killpg(proc.pid, 9)
        proc.wait(timeout=10)


def test_pollers_in_the_group_are_found_and_waiters_are_not(group):
    pid, ids = group
    found = {(t.pid, t.tid) for t in busy_threads(pid, window_s=1.0, share=0.2)}
    # two spinners share the host's cores with everything else: each gets a fair share
    assert (pid, ids["spinner"]) in found
    assert (ids["child"], ids["child"]) in found
    assert (pid, ids["waiter"]) not in found
    assert (pid, pid) not in found  # the main thread waits


def test_calming_lowers_the_pollers_priority_only(group):
    pid, ids = group
    deadline = time.monotonic() + 30
    calmed: list = []
    while not any(t.tid == ids["spinner"] for t in calmed):  # under load a sample can miss it
        assert time.monotonic() < deadline, calmed
        calmed = calm_idle_pollers(pid)
    assert _nice(pid, ids["spinner"]) == LOWEST_PRIORITY
    assert _nice(pid, ids["waiter"]) == 0
    assert _nice(pid, pid) == 0


def _own_cpu_s(pid: int) -> float:
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_group_cpu_adds_up_every_process_of_the_group_and_grows_while_it_polls(group):
    pid, ids = group
    parts = _own_cpu_s(pid) + _own_cpu_s(ids["child"])  # read first: the total is later
    total = group_cpu_s(pid)
    assert total >= parts
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
