"""Threads that keep an idle process busy, found and given the lowest CPU priority.

vLLM's NixlConnector creates a NIXL agent whose UCX progress thread polls with a zero delay
(NIXL's Python API fixes that delay at 0 and vLLM exposes no setting for it), so an idle
engine keeps a core busy. Where each engine is pinned to a core, as on CPU, that thread takes
its share of the cores the engines compute on, and every forward pass slows down. Lowering
its priority to nice 19 leaves it the cycles nothing else wants: it still runs whenever a core
is idle, as one is while an engine waits for a transfer.

Linux only (``/proc``); elsewhere nothing is found and nothing changes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from functools import partial

from vllm_pd_ext.util.proc_cpu import PROC, ThreadCpu, cpu_over, group_pids

LOWEST_PRIORITY = 19
#: A thread runnable for at least this share of the time while its process is idle is polling.
BUSY_SHARE = 0.5


def busy_threads(pgid: int, window_s: float = 1.0, share: float = BUSY_SHARE) -> list[ThreadCpu]:
    """Threads of process group ``pgid`` that were runnable (on a core, or queued for one) for
    at least ``share`` of a ``window_s`` sample, busiest first, each with the share of a core
    it used. Call it while the group is idle: then only pollers are runnable. Runnable, not
    running: on a loaded host a poller gets less than a core, but it never sleeps. Where the
    kernel keeps no per-thread scheduler times, the share of a core used decides."""
    before = _sched_times(pgid)
    if before is None:
        used = cpu_over({"group": partial(group_pids, pgid)}, window_s)["group"]
        return [t for t in used.threads if t.share >= share]
    start = time.monotonic()
    time.sleep(window_s)  # the sample window
    after = _sched_times(pgid) or {}
    elapsed_ns = (time.monotonic() - start) * 1e9
    found = []
    for (pid, tid), (ran, waited) in after.items():
        ran_before, waited_before = before.get((pid, tid), (0, 0))  # born since: from zero
        if (ran - ran_before + waited - waited_before) / elapsed_ns >= share:
            found.append(ThreadCpu(pid, tid, (ran - ran_before) / elapsed_ns))
    found.sort(key=lambda t: t.share, reverse=True)
    return found


def _sched_times(pgid: int) -> dict[tuple[int, int], tuple[int, int]] | None:
    """(pid, tid) -> (ns on a core, ns queued for one) so far, for every thread in group
    ``pgid`` (``/proc/PID/task/TID/schedstat``); None where the kernel keeps none."""
    if not (PROC / "self" / "schedstat").is_file():
        return None
    times = {}
    for pid in group_pids(pgid):
        try:
            tids = [t.name for t in (PROC / str(pid) / "task").iterdir()]
        except OSError:
            continue  # the process ended
        for tid in tids:
            try:
                ran, waited, _ = (PROC / str(pid) / "task" / tid / "schedstat").read_text().split()
            except (OSError, ValueError):
                continue  # the thread ended
            times[(pid, int(tid))] = (int(ran), int(waited))
    return times


def lower_priority(threads: Iterable[ThreadCpu]) -> list[ThreadCpu]:
    """Give each thread the lowest priority; return those it was done for."""
    done = []
    for thread in threads:
        try:
            os.setpriority(os.PRIO_PROCESS, thread.tid, LOWEST_PRIORITY)
        except OSError:
            continue  # the thread ended, or is not ours
        done.append(thread)
    return done


def calm_idle_pollers(pgid: int) -> list[ThreadCpu]:
    """Lower the priority of the threads polling in idle process group ``pgid``."""
    return lower_priority(busy_threads(pgid))


def summary(threads: list[ThreadCpu]) -> str:
    """One line for a log: what :func:`calm_idle_pollers` did."""
    listed = ", ".join(map(str, threads))
    return f"lowered the CPU priority of {len(threads)} thread(s) polling while idle ({listed})"
