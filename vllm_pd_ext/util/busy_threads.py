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
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
LOWEST_PRIORITY = 19
#: A thread using at least this share of one core while its process is idle is polling.
BUSY_SHARE = 0.5


@dataclass(frozen=True)
class BusyThread:
    pid: int
    tid: int
    share: float  # of one core, over the sample

    def __str__(self) -> str:
        return f"thread {self.tid} of pid {self.pid} at {self.share:.0%} of a core"


def _stat_fields(path: Path) -> list[str] | None:
    """The fields of a ``stat`` file after the command name (state first), or None."""
    try:
        text = path.read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def group_pids(pgid: int) -> list[int]:
    """Every process in process group ``pgid``."""
    pids = []
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(entry / "stat")
            if fields is not None and int(fields[2]) == pgid:
                pids.append(int(entry.name))
    return pids


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system, every thread, ended ones included) that the processes now
    in group ``pgid`` have used so far; 0.0 where there is no ``/proc``."""
    if not PROC.is_dir():
        return 0.0
    ticks = 0
    for pid in group_pids(pgid):
        fields = _stat_fields(PROC / str(pid) / "stat")
        if fields is not None:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def _cpu_ticks(pids: Iterable[int]) -> dict[tuple[int, int], int]:
    """(pid, tid) -> user + system clock ticks so far, for every thread of ``pids``."""
    ticks = {}
    for pid in pids:
        try:
            tids = [int(t.name) for t in (PROC / str(pid) / "task").iterdir()]
        except OSError:
            continue  # the process ended
        for tid in tids:
            fields = _stat_fields(PROC / str(pid) / "task" / str(tid) / "stat")
            if fields is not None:
                ticks[(pid, tid)] = int(fields[11]) + int(fields[12])
    return ticks


def busy_threads(pgid: int, window_s: float = 1.0, share: float = BUSY_SHARE) -> list[BusyThread]:
    """Threads of process group ``pgid`` that used at least ``share`` of a core over a
    ``window_s`` sample. Call it while the group is idle: then only pollers are busy."""
    if not PROC.is_dir():
        return []
    pids = group_pids(pgid)
    before = _cpu_ticks(pids)
    start = time.monotonic()
    time.sleep(window_s)  # the measurement window
    after = _cpu_ticks(pids)
    window_ticks = (time.monotonic() - start) * os.sysconf("SC_CLK_TCK")
    found = []
    for key, ticks in after.items():
        if key in before and (ticks - before[key]) / window_ticks >= share:
            found.append(BusyThread(key[0], key[1], (ticks - before[key]) / window_ticks))
    return found


def lower_priority(threads: Iterable[BusyThread]) -> list[BusyThread]:
    """Give each thread the lowest priority; return those it was done for."""
    done = []
    for thread in threads:
        try:
            os.setpriority(os.PRIO_PROCESS, thread.tid, LOWEST_PRIORITY)
        except OSError:
            continue  # the thread ended, or is not ours
        done.append(thread)
    return done


def calm_idle_pollers(pgid: int) -> list[BusyThread]:
    """Lower the priority of the threads polling in idle process group ``pgid``."""
    return lower_priority(busy_threads(pgid))


def summary(threads: list[BusyThread]) -> str:
    """One line for a log: what :func:`calm_idle_pollers` did."""
    listed = ", ".join(map(str, threads))
    return f"lowered the CPU priority of {len(threads)} thread(s) polling while idle ({listed})"
