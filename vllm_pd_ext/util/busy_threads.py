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
from collections.abc import Iterable
from functools import partial

from vllm_pd_ext.util.proc_cpu import ThreadCpu, cpu_over, group_pids

LOWEST_PRIORITY = 19
#: A thread using at least this share of one core while its process is idle is polling.
BUSY_SHARE = 0.5


def busy_threads(pgid: int, window_s: float = 1.0, share: float = BUSY_SHARE) -> list[ThreadCpu]:
    """Threads of process group ``pgid`` that used at least ``share`` of a core over a
    ``window_s`` sample, busiest first. Call it while the group is idle: then only pollers
    are busy."""
    used = cpu_over({"group": partial(group_pids, pgid)}, window_s)["group"]
    return [t for t in used.threads if t.share >= share]


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
