"""CPU use of local processes, read from ``/proc``: how much of a core a process tree (a
server with its children: a ``vllm serve`` API server, its EngineCore and workers) uses over a
window, which of its threads used it, and which local process listens on a TCP port.

Linux only (``/proc``); elsewhere no process is found and every figure is 0.

A process's CPU time so far (:func:`process_cpu_ns`) is read to the nanosecond where Linux
allows: from its process CPU clock (``clock_gettime`` on the clock of another pid: every
thread, ended ones included), else by summing the first field of ``schedstat`` (ns on CPU)
over its live threads, else in clock ticks (``utime + stime`` of ``stat``, 10 ms apiece with
the usual ``CLK_TCK`` of 100). Windows over processes (:func:`cpu_over`) count in ticks.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import psutil

PROC = Path("/proc")
#: Host names that are this host whatever its interfaces.
LOOPBACK_NAMES = ("localhost", "localhost.localdomain")


@dataclass(frozen=True)
class ThreadCpu:
    pid: int
    tid: int
    share: float  # of one core, over the window

    @property
    def name(self) -> str:
        """The thread's name (``comm``), or ``?`` once it has ended."""
        try:
            return (PROC / str(self.pid) / "task" / str(self.tid) / "comm").read_text().strip()
        except OSError:
            return "?"

    def __str__(self) -> str:
        return f"thread {self.tid} of pid {self.pid} at {self.share:.0%} of a core"


@dataclass(frozen=True)
class TreeCpu:
    """What one process tree used over a window."""

    share: float  # of one core: 1.0 is one core busy for the whole window
    pids: tuple[int, ...]  # the tree's processes at the window's end
    threads: tuple[ThreadCpu, ...]  # busiest first; those that used any CPU

    @property
    def pct(self) -> float:
        """``share`` in % of one core, to one decimal."""
        return round(100 * self.share, 1)


def stat_fields(path: Path) -> list[str] | None:
    """The fields of a ``stat`` file after the command name (state first), or None."""
    try:
        text = path.read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


#: How a process's CPU time was read, finest first (see the module docstring).
CPU_METHODS = ("cpu-clock", "schedstat", "ticks")
#: ``CPUCLOCK_SCHED``: the kind of a pid's CPU clock that counts scheduler runtime in ns.
_CPUCLOCK_SCHED = 2


def _ticks(fields: list[str]) -> int:
    return int(fields[11]) + int(fields[12])  # utime + stime


def group_pids(pgid: int) -> list[int]:
    """Every process in process group ``pgid``."""
    if not PROC.is_dir():
        return []
    pids = []
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            fields = stat_fields(entry / "stat")
            if fields is not None and int(fields[2]) == pgid:
                pids.append(int(entry.name))
    return pids


def tree_pids(pid: int) -> list[int]:
    """``pid`` and every process descended from it; [] when ``pid`` has ended."""
    try:
        root = psutil.Process(pid)
        return [pid, *(child.pid for child in root.children(recursive=True))]
    except psutil.Error:
        return []


def process_ticks(pids: Iterable[int]) -> dict[int, int]:
    """pid -> user + system clock ticks so far (every thread, ended ones included)."""
    ticks = {}
    for pid in pids:
        fields = stat_fields(PROC / str(pid) / "stat")
        if fields is not None:
            ticks[pid] = _ticks(fields)
    return ticks


def thread_ticks(pids: Iterable[int]) -> dict[tuple[int, int], int]:
    """(pid, tid) -> user + system clock ticks so far, for every live thread of ``pids``."""
    ticks = {}
    for pid in pids:
        try:
            tids = [int(t.name) for t in (PROC / str(pid) / "task").iterdir()]
        except OSError:
            continue  # the process ended
        for tid in tids:
            fields = stat_fields(PROC / str(pid) / "task" / str(tid) / "stat")
            if fields is not None:
                ticks[(pid, tid)] = _ticks(fields)
    return ticks


def _clock_ns(pid: int) -> int | None:
    """ns on CPU of every thread of ``pid`` so far, ended ones included, from its process CPU
    clock (the id glibc's ``clock_getcpuclockid`` makes), or None when it cannot be read."""
    clock = (~pid << 3) | _CPUCLOCK_SCHED
    try:
        return time.clock_gettime_ns(clock)
    except (OSError, OverflowError, AttributeError):
        return None


def _schedstat_ns(pid: int) -> int | None:
    """ns on CPU so far summed over the live threads of ``pid`` (``schedstat``'s first
    field), or None when the process has ended or the kernel keeps no ``schedstat``."""
    try:
        tasks = list((PROC / str(pid) / "task").iterdir())
    except OSError:
        return None
    total, seen = 0, False
    for task in tasks:
        try:
            total += int((task / "schedstat").read_text().split()[0])
            seen = True
        except (OSError, ValueError, IndexError):
            continue  # the thread ended, or no schedstat
    return total if seen else None


def process_cpu_ns(pid: int) -> tuple[int, str] | None:
    """CPU time ``pid`` has used so far in ns, and how it was read (one of
    :data:`CPU_METHODS`), or None when the process has ended. Only ``cpu-clock`` and
    ``ticks`` count threads that have ended."""
    ns = _clock_ns(pid)
    if ns is not None:
        return ns, CPU_METHODS[0]
    ns = _schedstat_ns(pid)
    if ns is not None:
        return ns, CPU_METHODS[1]
    fields = stat_fields(PROC / str(pid) / "stat")
    if fields is None:
        return None
    return _ticks(fields) * 1_000_000_000 // os.sysconf("SC_CLK_TCK"), CPU_METHODS[2]


@dataclass(frozen=True)
class GroupCpu:
    """CPU time a process group has used so far."""

    s: float  # seconds, every process now in the group
    method: str  # the coarsest of :data:`CPU_METHODS` used for any of them ("" for none)


def group_cpu(pgid: int) -> GroupCpu:
    """CPU seconds that the processes now in group ``pgid`` have used so far, read as finely
    as Linux allows (:func:`process_cpu_ns`); 0.0 where there is no ``/proc``."""
    total, coarsest = 0, -1
    for pid in group_pids(pgid):
        read = process_cpu_ns(pid)
        if read is not None:
            total += read[0]
            coarsest = max(coarsest, CPU_METHODS.index(read[1]))
    return GroupCpu(total / 1e9, CPU_METHODS[coarsest] if coarsest >= 0 else "")


def group_cpu_s(pgid: int) -> float:
    """:attr:`GroupCpu.s` of :func:`group_cpu`."""
    return group_cpu(pgid).s


@dataclass(frozen=True)
class _Snapshot:
    at: float
    procs: dict[int, int]
    threads: dict[tuple[int, int], int]


def _snapshot(pids: list[int]) -> _Snapshot:
    return _Snapshot(time.monotonic(), process_ticks(pids), thread_ticks(pids))


def _used(before: _Snapshot, after: _Snapshot) -> TreeCpu:
    """CPU between two snapshots of one tree: a process or thread born in between counts from
    zero, one that ended in between is left out (its last ticks are gone with it)."""
    per_tick = (after.at - before.at) * os.sysconf("SC_CLK_TCK")
    if per_tick <= 0:
        return TreeCpu(0.0, tuple(after.procs), ())
    ticks = sum(t - before.procs.get(pid, 0) for pid, t in after.procs.items())
    threads = [
        ThreadCpu(pid, tid, (t - before.threads.get((pid, tid), 0)) / per_tick)
        for (pid, tid), t in after.threads.items()
        if t > before.threads.get((pid, tid), 0)
    ]
    threads.sort(key=lambda th: th.share, reverse=True)
    return TreeCpu(max(0.0, ticks / per_tick), tuple(after.procs), tuple(threads))


def cpu_over(sources: Mapping[str, Callable[[], list[int]]], window_s: float) -> dict[str, TreeCpu]:
    """What each named set of processes used over the next ``window_s`` seconds; each source
    lists its processes, and is asked at both ends of the window (a process born in between
    counts from zero). The sets are read together, so the windows are the same.

    Blocks the calling thread for the window.
    """
    before = {name: _snapshot(pids()) for name, pids in sources.items()}
    time.sleep(window_s)  # the measurement window
    after = {name: _snapshot(pids()) for name, pids in sources.items()}
    return {name: _used(before[name], after[name]) for name in sources}


def trees_cpu(roots: Mapping[str, int], window_s: float) -> dict[str, TreeCpu]:
    """What each named process tree (``roots``: name -> the tree's root pid) used over the next
    ``window_s`` seconds (see :func:`cpu_over`); a tree whose root has ended reads 0."""
    return cpu_over({name: partial(tree_pids, pid) for name, pid in roots.items()}, window_s)


def is_local_host(host: str) -> bool:
    """Whether ``host`` (a name or an address, as in a URL) is this host: a loopback address,
    ``localhost``, or an address of one of this host's interfaces. Resolves nothing."""
    host = host.strip("[]")
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return host.lower() in {socket.gethostname().lower(), socket.getfqdn().lower()}
    if addr.is_loopback:
        return True
    return any(
        a.address.split("%")[0] == str(addr)
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family in (socket.AF_INET, socket.AF_INET6)
    )


def listening_pid(port: int) -> int | None:
    """The local process listening on TCP ``port`` (any address), or None when nothing
    listens there or the listener belongs to another user (its sockets are not readable).
    Of processes sharing the listening socket (a server and the workers it forked), the
    eldest."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except psutil.Error:
        return None
    pid = next(
        (
            c.pid
            for c in conns
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid
        ),
        None,
    )
    if pid is None:
        return None
    try:
        for parent in psutil.Process(pid).parents():
            if not _listens(parent, port):
                break
            pid = parent.pid
    except psutil.Error:
        pass  # the process or a parent ended: the last one found
    return pid


def _listens(proc: psutil.Process, port: int) -> bool:
    try:
        conns = proc.net_connections(kind="tcp")
    except psutil.Error:
        return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in conns)
