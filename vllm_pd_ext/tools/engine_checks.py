"""Checks of a running engine that need no request of their own: its CPU while idle (an idle
engine should be idle; vLLM's NixlConnector's progress thread polls without pause), and the
connector counters on its ``/metrics`` that say KV was freed unread or may have been read
invalid. ``vllm-pd doctor`` runs them around its measurements.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from vllm_pd_ext.util.proc_cpu import TreeCpu, is_local_host, listening_pid, trees_cpu
from vllm_pd_ext.util.prom import Metrics

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
#: Our connectors' gauge of prefill-side blocks held for decode instances: while any are
#: held, vLLM keeps stepping the engine (it waits for the connector to release them).
BLOCKS_HELD = "vllm:pdext_kv_blocks_held"
#: The window over which an idle engine's CPU is measured.
IDLE_WINDOW_S = 2.0
#: How long an engine found idle is left before its window: vLLM's workers keep polling their
#: shared-memory queue for 1 s after each step (``SpinCondition``), which is not idle polling.
SETTLE_S = 1.5
#: An idle engine using at least this much of one core (%) is busy-polling.
BUSY_POLL_PCT = 20.0
#: A thread using at least this much of one core (%) is named in the warning.
BUSY_THREAD_PCT = 10.0


@dataclass(frozen=True)
class KvCounter:
    """A counter (its sample name, and labels) whose rise means KV was lost or may be wrong."""

    sample: str
    meaning: str
    labels: tuple[tuple[str, str], ...] = ()

    @property
    def label(self) -> str:
        """The sample as Prometheus writes it, labels included."""
        inner = ",".join(f'{k}="{v}"' for k, v in self.labels)
        return f"{self.sample}{{{inner}}}" if inner else self.sample

    def value(self, metrics: Metrics) -> float:
        return metrics.total(self.sample, **dict(self.labels))


_RECOMPUTED = "those requests were recomputed or failed (kv_load_failure_policy)"

#: Our connectors' counters (vllm_pd_ext.connectors.common.stats), vLLM's NixlConnector's
#: (nixl/stats.py), and vLLM's own count of requests ended in error.
KV_COUNTERS = (
    KvCounter(
        "vllm:pdext_kv_lease_expiries_total",
        "prefill-side leases ran out: KV blocks freed before a decode instance read them; "
        + _RECOMPUTED,
    ),
    KvCounter(
        "vllm:pdext_kv_transfer_failures_total",
        "KV transfers failed or timed out: " + _RECOMPUTED,
    ),
    KvCounter(
        "vllm:pdext_kv_params_refused_total",
        "decode requests' kv_transfer_params refused (malformed, unsigned, expired) or KV "
        "written for another prompt: computed locally instead",
    ),
    KvCounter(
        "vllm:pdext_kv_unauthenticated_total",
        "side-channel requests or data connections without a valid fleet-key tag were refused",
    ),
    KvCounter(
        "vllm:pdext_kv_ungranted_total",
        "peers' reads or writes beyond the KV blocks granted to them were refused",
    ),
    KvCounter(
        "vllm:nixl_num_failed_transfers_total",
        "NIXL transfers, handshakes or notifications failed: " + _RECOMPUTED,
    ),
    KvCounter(
        "vllm:nixl_num_kv_expired_reqs_total",
        "NIXL prefill-side KV expired before a decode instance read it: " + _RECOMPUTED,
    ),
    KvCounter(
        "vllm:nixl_num_notifications_after_expiry_total",
        "NIXL completions arrived for KV already expired: its blocks may have been reused "
        "before the transfer finished, so INVALID KV MAY HAVE BEEN READ",
    ),
    KvCounter(
        "vllm:request_success_total",
        "requests ended in error (a KV load failure does this under kv_load_failure_policy=fail)",
        (("finished_reason", "error"),),
    ),
)


@dataclass(frozen=True)
class CounterMove:
    role: str
    url: str
    counter: str
    moved: float
    meaning: str

    def __str__(self) -> str:
        return f"{self.role} {self.url}: {self.counter} rose by {self.moved:g}: {self.meaning}"


def counter_moves(
    role: str,
    url: str,
    before: Metrics,
    after: Metrics,
    counters: tuple[KvCounter, ...] = KV_COUNTERS,
) -> list[CounterMove]:
    """The counters of ``counters`` that rose from ``before`` to ``after`` (two scrapes of the
    engine at ``url``); a counter the engine does not export never rises."""
    moves = []
    for c in counters:
        moved = c.value(after) - c.value(before)
        if moved > 0:
            moves.append(CounterMove(role, url, c.label, moved, c.meaning))
    return moves


@dataclass(frozen=True)
class EngineIdle:
    """An engine's CPU while it serves nothing: ``cpu_pct`` in % of one core (its process
    tree: API server, EngineCore, workers), or None with ``note`` saying why it was not
    measured."""

    role: str
    url: str
    cpu_pct: float | None
    note: str = ""
    busy_threads: tuple[str, ...] = ()  # "name (tid): N%", busiest first
    blocks_held: float = 0.0  # BLOCKS_HELD at the end of the window
    connector: str = ""  # "nixl", "pdext" (ours) or "" (neither), from the metrics it exports

    def line(self) -> str:
        if self.cpu_pct is None:
            return f"{self.role} {self.url}: idle CPU n/a ({self.note})"
        threads = f" (busiest: {', '.join(self.busy_threads)})" if self.busy_threads else ""
        return f"{self.role} {self.url}: idle CPU {self.cpu_pct:.1f}% of a core{threads}"

    def warning(self, busy_pct: float = BUSY_POLL_PCT) -> str | None:
        """What to do about an engine busy while idle; None when it is not."""
        if self.cpu_pct is None or self.cpu_pct < busy_pct:
            return None
        head = f"{self.role} {self.url} busy-polls: {self.cpu_pct:.0f}% of a core while idle"
        if self.busy_threads:
            head += f" ({', '.join(self.busy_threads)})"
        if self.blocks_held:
            return (
                f"{head}: it holds {self.blocks_held:g} KV blocks for decode instances, and "
                "vLLM steps the engine until they are read or their lease runs out"
            )
        if self.connector == "nixl":
            return (
                f"{head}: vLLM's NixlConnector's progress thread polls without pause; `vllm-pd "
                "up` lowers that thread's priority (nice 19) so it takes only idle cycles, or "
                "serve with our connector (PdExtMoRIIOConnector), which does not poll"
            )
        return (
            f"{head}: a thread polls without pause (vLLM's NixlConnector's progress thread "
            "does; `vllm-pd up` lowers its priority), or the engine keeps stepping"
        )


def connector_of(metrics: Metrics) -> str:
    """Which P/D connector an engine runs, by the metrics it exports: "nixl", "pdext" (ours)
    or "" (neither, or none yet)."""
    names = metrics.names()
    for connector in ("nixl", "pdext"):
        if any(n.startswith(f"vllm:{connector}_") for n in names):
            return connector
    return ""


def engine_port(url: str) -> tuple[str, int]:
    """(host, port) of an engine URL (the scheme's default port when none is given)."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts.hostname or "", port


def _threads(used: TreeCpu) -> tuple[str, ...]:
    return tuple(
        f"{t.name} ({t.tid}): {100 * t.share:.0f}%"
        for t in used.threads
        if 100 * t.share >= BUSY_THREAD_PCT
    )


def measure_idle(
    engines: Mapping[str, str],
    scrape: Callable[[str], Metrics],
    window_s: float,
    *,
    settle_s: float = SETTLE_S,
    find_pid: Callable[[int], int | None] = listening_pid,
    measure: Callable[[Mapping[str, int], float], dict[str, TreeCpu]] = trees_cpu,
) -> list[EngineIdle]:
    """Idle CPU of each engine (``engines``: role -> URL) over one ``window_s`` window, all
    engines at once, ``settle_s`` after they were found idle: only engines on this host (found
    by the port they listen on) that report no running or waiting request before and after
    the window are measured.

    Blocks for ``settle_s`` and the window; ``scrape`` reads an engine's ``/metrics``.
    """
    out: dict[str, EngineIdle] = {}
    roots: dict[str, int] = {}
    for role, url in engines.items():
        host, port = engine_port(url)
        if not is_local_host(host):
            out[role] = EngineIdle(role, url, None, "not on this host")
            continue
        pid = find_pid(port)
        if pid is None:
            out[role] = EngineIdle(
                role, url, None, f"no process of this user listens on port {port}"
            )
            continue
        busy = _requests(scrape(url))
        if busy:
            out[role] = EngineIdle(role, url, None, f"not idle: {busy}")
            continue
        roots[role] = pid
    if roots:
        time.sleep(settle_s)  # past the workers' polling after their last step
        used = measure(roots, window_s)
        for role in roots:
            url = engines[role]
            after = scrape(url)
            busy = _requests(after)
            if busy:
                out[role] = EngineIdle(
                    role, url, None, f"requests arrived during the window: {busy}"
                )
            else:
                out[role] = EngineIdle(
                    role,
                    url,
                    used[role].pct,
                    busy_threads=_threads(used[role]),
                    blocks_held=after.total(BLOCKS_HELD),
                    connector=connector_of(after),
                )
    return [out[role] for role in engines]


def _requests(metrics: Metrics) -> str:
    """'N running, M waiting' when the engine has any request, else ''."""
    running, waiting = metrics.total(RUNNING), metrics.total(WAITING)
    return f"{running:g} running, {waiting:g} waiting" if running or waiting else ""
