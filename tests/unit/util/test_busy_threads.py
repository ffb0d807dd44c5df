"""Finding the threads that keep an idle process group busy, and lowering their priority."""

from __future__ import annotations

import time
from pathlib import Path

from vllm_pd_ext.util.busy_threads import LOWEST_PRIORITY, busy_threads, calm_idle_pollers


def _nice(pid: int, tid: int) -> int:
    text = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
    return int(text[text.rindex(")") + 2 :].split()[16])


def test_pollers_in_the_group_are_found_and_waiters_are_not(group):
    pid, ids = group
    spinners = {(pid, ids["spinner"]), (ids["child"], ids["child"])}
    deadline = time.monotonic() + 30
    found: set = set()
    while not spinners <= found:  # on a loaded host one window can miss a spinner's share
        assert time.monotonic() < deadline, found
        sample = {(t.pid, t.tid) for t in busy_threads(pid, window_s=1.0, share=0.2)}
        assert (pid, ids["waiter"]) not in sample
        assert (pid, pid) not in sample  # the main thread waits
        found |= sample


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
