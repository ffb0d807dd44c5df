"""The fleet: engine instances, their health and load, and the HTTP client for each.

Health is checked actively (``GET /health`` with exponential backoff after failures) and
passively (a connection error while proxying marks the instance down at once). Load comes from
the engine's ``/metrics`` (running and waiting requests, KV usage) plus the proxy's own
in-flight count, which moves the moment a request is routed (``Instance.lease``). Engine
figures older than ``stale_after_rounds`` health rounds (``/metrics`` stopped answering) are
dropped: the instance then counts only what this proxy has in flight on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from vllm_pd_ext.proxy.config import InstanceConfig, ProxyConfig
from vllm_pd_ext.proxy.kv_events import Lookup, PrefixIndex, Subscriber
from vllm_pd_ext.proxy.sources import FileSource, FleetSource, KubernetesSource
from vllm_pd_ext.proxy.upstream import Timeouts, Upstream, UpstreamError
from vllm_pd_ext.util.prom import parse_metrics

logger = logging.getLogger(__name__)

#: The engine gauges the fleet reads for load, as line prefixes of the Prometheus text.
LOAD_METRICS = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
)
#: vLLM's cache settings as labels of a gauge set to 1; the fleet reads whether prefix
#: caching is on, and the KV cache's size (blocks, tokens per block).
CACHE_INFO = "vllm:cache_config_info"

#: How the proxy knows what an instance's prefix cache holds: from its KV events (a prefix
#: index), or by the prefix-affinity estimate (no events, or their subscription failed).
CACHE_VIEWS = ("events", "estimate")

#: Health rounds without a readable ``/metrics`` after which an instance's engine figures
#: (running, waiting, KV usage) are dropped.
STALE_AFTER_ROUNDS = 3

_NEEDLES = tuple(b"\n" + name.encode() for name in (*LOAD_METRICS, CACHE_INFO))


def _one_int(values: Iterable[str]) -> int:
    """The one positive integer among a label's ``values``, else 0 (absent, "None", or several
    engines that differ)."""
    found = {v for v in values if v.isdigit() and int(v) > 0}
    return int(found.pop()) if len(found) == 1 else 0


def _follow_events(inst: Instance) -> None:
    """Subscribe to ``inst``'s KV events, when its config names where they are published."""
    cfg = inst.config.kv_events
    if cfg is None:
        return
    inst.events = Subscriber(PrefixIndex(), cfg.endpoint, cfg.replay_endpoint, cfg.topic)
    inst.events.start()
    logger.info("fleet: %s: following its KV events at %s", inst.label, cfg.endpoint)


async def _stop_events(inst: Instance) -> None:
    events, inst.events = inst.events, None
    if events is not None:
        await events.close()


def _load_lines(raw: bytes) -> str:
    """The lines of ``raw`` (Prometheus text) that hold a ``LOAD_METRICS`` or ``CACHE_INFO``
    sample."""
    text = b"\n" + raw
    found: list[bytes] = []
    for needle in _NEEDLES:
        at = text.find(needle)
        while at >= 0:
            end = text.find(b"\n", at + 1)
            if end < 0:
                end = len(text)
            if text[at + len(needle) : at + len(needle) + 1] in (b"{", b" "):
                found.append(text[at + 1 : end])
            at = text.find(needle, end)
    return b"\n".join(found).decode("utf-8", "replace")


@dataclass(eq=False)
class Instance:
    """One engine as the proxy sees it. Mutated only on the proxy's event loop."""

    config: InstanceConfig
    client: Upstream
    healthy: bool = False
    failures: int = 0
    next_check: float = 0.0
    in_flight: int = 0
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    #: Does the engine's prefix cache keep prompts (None: it has not said, in ``/metrics``)?
    prefix_caching: bool | None = None
    #: What its prefix cache holds, from its KV events (None: it publishes none to us).
    events: Subscriber | None = field(default=None, repr=False)
    last_error: str = ""
    #: When the engine figures were last read (monotonic; 0: never).
    metrics_at: float = field(default=0.0, repr=False)
    #: The engine's KV cache: blocks and tokens per block (0: it has not said).
    kv_blocks: int = 0
    block_size: int = 0
    #: KV blocks of splits routed here whose KV has not landed yet (``Call.reserve``), and
    #: of those that landed since the last scrape (its KV usage does not show them yet).
    reserved_blocks: int = 0
    landed_blocks: int = 0

    @property
    def url(self) -> str:
        return self.config.url

    @property
    def role(self) -> str:
        return self.config.role

    @property
    def label(self) -> str:
        return self.config.label

    def serves(self, role: str) -> bool:
        return self.config.role in (role, "both")

    def load(self) -> float:
        """In-flight through us, plus what the engine reported running and waiting."""
        return self.in_flight + self.running + 2.0 * self.waiting

    @property
    def cache_view(self) -> str:
        """One of ``CACHE_VIEWS``."""
        events = self.events
        return "events" if events is not None and not events.failed else "estimate"

    def cached_tokens(self, prompt: Lookup) -> int | None:
        """How many of the prompt's leading tokens the engine's prefix cache holds, from its
        KV events; None when it has no prefix index (``cache_view`` is the estimate)."""
        events = self.events
        if events is None or events.failed:
            return None
        index = events.index
        size = index.block_size
        return 0 if size is None else index.held(prompt) * size

    def free_blocks(self) -> int | None:
        """The KV blocks the engine has room for, by its last scrape less what splits routed
        here since will take; None when its cache size is not known."""
        if not self.kv_blocks or not self.metrics_at:
            return None
        free = int(self.kv_blocks * (1.0 - self.kv_usage))
        return free - self.reserved_blocks - self.landed_blocks

    def mark_ok(self) -> None:
        self.healthy = True
        self.failures = 0
        self.last_error = ""

    def mark_failed(self, error: str, backoff_max: float) -> None:
        """Take the instance out of rotation and back off before the next health check."""
        self.healthy = False
        self.failures = max(self.failures, 1)
        self.last_error = error
        self.next_check = time.monotonic() + min(backoff_max, 0.5 * 2 ** min(self.failures, 8))


class Lease:
    """One request's share of an instance's in-flight count: taken when made, given back
    exactly once by ``release()`` or by leaving its ``with`` block, on every path.

    A lease ``kept`` by a longer-lived owner (a stream that outlives the block that opened
    it, see ``Call.hold``) is not given back when the block exits: its owner releases it.
    """

    __slots__ = ("instance", "kept")

    def __init__(self, instance: Instance):
        instance.in_flight += 1
        self.instance: Instance | None = instance
        self.kept = False

    def release(self) -> None:
        inst = self.instance
        if inst is not None:
            self.instance = None
            inst.in_flight -= 1

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if not self.kept:
            self.release()


class Fleet:
    """All instances, kept healthy and loaded by one background task."""

    def __init__(self, config: ProxyConfig):
        self.config = config
        self._instances: dict[str, Instance] = {}
        self._task: asyncio.Task | None = None
        self._sources: list[FleetSource] = []
        if config.instances_file is not None:
            self._sources.append(FileSource(config.instances_file))
        if config.kubernetes is not None:
            self._sources.append(KubernetesSource(config.kubernetes))
        self._seen: dict[str, list[InstanceConfig]] = {}
        self._retired: list[Instance] = []
        #: Set when the health round under way ends (then replaced for the next).
        self._round = asyncio.Event()
        t = config.timeouts
        self._health_timeout = Timeouts(total=t.health_s, connect=t.connect_s).client()

    # -- membership ---------------------------------------------------------------------

    def _client(self, url: str) -> Upstream:
        return Upstream(url, max_connections=self.config.max_in_flight * 2)

    async def set_instances(self, configs: Iterable[InstanceConfig]) -> None:
        """Make the fleet exactly ``configs``: add new URLs, drop missing ones, keep state."""
        wanted = {c.url: c for c in configs}
        for url in list(self._instances):
            if url not in wanted:
                old = self._instances.pop(url)
                old.healthy = False
                logger.info("fleet: removed %s", old.label)
                self._retired.append(old)  # closed once its in-flight requests finish
        await self._close_retired()
        for url, cfg in wanted.items():
            current = self._instances.get(url)
            if current is None:
                current = self._instances[url] = Instance(cfg, self._client(url))
                logger.info("fleet: added %s as %s", cfg.label, cfg.role)
                _follow_events(current)
            elif current.config != cfg:
                events_changed = current.config.kv_events != cfg.kv_events
                current.config = cfg
                if events_changed:
                    await _stop_events(current)
                    _follow_events(current)

    def instances(self) -> list[Instance]:
        return list(self._instances.values())

    def healthy(self, role: str) -> list[Instance]:
        roles = (role, "both")  # ``Instance.serves``, without a call per instance and request
        return [i for i in self._instances.values() if i.healthy and i.config.role in roles]

    def upstream_failed(self, inst: Instance, exc: UpstreamError) -> None:
        """A request to ``inst`` failed: take it out of rotation when the failure says it is
        gone (not on timeouts, which a busy engine causes)."""
        if exc.down:
            inst.mark_failed(str(exc), self.config.health_backoff_max_s)
        logger.warning("upstream %s failed: %s", inst.label, exc)

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Load the initial members, check them all once, then keep checking in background."""
        await self.set_instances(self.config.instances)
        await self._refresh_sources()
        await self.check_all()
        self._task = asyncio.create_task(self._loop(), name="fleet-health")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for inst in [*self._instances.values(), *self._retired]:
            await _stop_events(inst)
            await inst.client.close()
        for source in self._sources:
            await source.close()
        self._instances.clear()
        self._retired.clear()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            try:
                await self._refresh_sources()
                await self.check_all()
            except Exception:  # the loop must survive anything one round throws
                logger.exception("fleet: health round failed")
            done, self._round = self._round, asyncio.Event()
            done.set()

    async def next_round(self) -> None:
        """Until the next health round has ended (its scrapes read)."""
        await self._round.wait()

    async def _refresh_sources(self) -> None:
        changed = False
        for source in self._sources:
            configs = await source.fetch()
            if configs is not None and configs != self._seen.get(source.name):
                self._seen[source.name] = configs
                changed = True
        if changed:
            dynamic = [c for configs in self._seen.values() for c in configs]
            await self.set_instances([*self.config.instances, *dynamic])

    async def _close_retired(self) -> None:
        for inst in [i for i in self._retired if i.in_flight == 0]:
            self._retired.remove(inst)
            await _stop_events(inst)
            await inst.client.close()

    async def check_all(self) -> None:
        await self._close_retired()
        now = time.monotonic()
        due = [i for i in self._instances.values() if i.next_check <= now]
        await asyncio.gather(*(self._check(i) for i in due))

    async def _check(self, inst: Instance) -> None:
        try:
            status, _ = await inst.client.fetch("GET", "/health", self._health_timeout)
            if status != 200:
                raise UpstreamError("unhealthy", f"/health answered HTTP {status}")
            status, text = await inst.client.fetch("GET", "/metrics", self._health_timeout)
        except UpstreamError as exc:
            # A refused connection is decisive; a slow or failing answer from a busy engine
            # takes `unhealthy_after` rounds in a row, so load alone does not eject it.
            was = inst.healthy
            inst.failures += 1
            if exc.kind == "connect" or inst.failures >= self.config.unhealthy_after:
                inst.mark_failed(str(exc), self.config.health_backoff_max_s)
                if was:
                    logger.warning("fleet: %s is down: %s", inst.label, inst.last_error)
            self._drop_stale_load(inst)
            return
        if not inst.healthy:
            logger.info("fleet: %s is healthy", inst.label)
            if inst.failures and inst.events is not None:  # back from down: maybe restarted
                inst.events.resync()
        inst.mark_ok()
        if status != 200 or not self._read_load(inst, text):
            self._drop_stale_load(inst)

    def _drop_stale_load(self, inst: Instance) -> None:
        """Forget engine figures that no scrape has confirmed for a few rounds."""
        if not inst.metrics_at:
            return
        stale_s = STALE_AFTER_ROUNDS * self.config.health_interval_s
        if time.monotonic() - inst.metrics_at > stale_s:
            logger.warning(
                "fleet: %s: no readable /metrics for %.0f s; its load figures are dropped",
                inst.label,
                stale_s,
            )
            inst.running = inst.waiting = inst.kv_usage = 0.0
            inst.metrics_at = 0.0

    @staticmethod
    def _read_load(inst: Instance, raw: bytes) -> bool:
        """Read the load gauges of a scrape into ``inst``; False when it holds none."""
        # vLLM's /metrics is ~50 KB; parsing all of it costs ~30 ms of event-loop time per
        # scrape, which every in-flight request would wait for, and even splitting it into
        # lines ~0.3 ms. Find the three gauges' lines with bytes.find and parse only those.
        wanted = _load_lines(raw)
        if not wanted:  # not a vLLM scrape
            return False
        try:
            m = parse_metrics(wanted)
        except Exception:  # a scrape we cannot parse
            return False
        inst.running = m.total("vllm:num_requests_running")
        inst.waiting = m.total("vllm:num_requests_waiting")
        inst.kv_usage = m.total("vllm:kv_cache_usage_perc")
        inst.landed_blocks = 0  # the usage just read shows them
        caching = m.by_label(CACHE_INFO, "enable_prefix_caching")
        if caching:
            inst.prefix_caching = "True" in caching
        inst.kv_blocks = _one_int(m.by_label(CACHE_INFO, "num_gpu_blocks"))
        inst.block_size = _one_int(m.by_label(CACHE_INFO, "block_size"))
        inst.metrics_at = time.monotonic()
        return True
