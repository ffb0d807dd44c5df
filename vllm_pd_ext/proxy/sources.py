"""Dynamic fleet sources: a watched file and Kubernetes pods by label selector.

Each source's ``fetch()`` returns the instances it currently sees, or None to keep what it
last returned (unchanged, or a failed read: a bad edit or an API outage never empties a
fleet).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import time
from pathlib import Path
from typing import Any, Protocol

import httpx

from vllm_pd_ext.proxy.config import (
    InstanceConfig,
    KubernetesConfig,
    KVEventsConfig,
    read_instances,
)

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "both")


class FleetSource(Protocol):
    name: str

    async def fetch(self) -> list[InstanceConfig] | None:
        """Current members, or None to keep the last answer. Runs on the proxy's loop."""
        ...

    async def close(self) -> None: ...


class FileSource:
    """A JSON/YAML file with an ``instances`` list, re-read when its mtime changes."""

    def __init__(self, path: Path):
        self.name = f"file:{path}"
        self.path = path
        self._mtime: float | None = None

    async def fetch(self) -> list[InstanceConfig] | None:
        try:
            mtime = self.path.stat().st_mtime
        except OSError as exc:
            logger.warning("fleet: cannot read %s: %s", self.path, exc)
            return None
        if mtime == self._mtime:
            return None
        try:
            configs = list(read_instances(self.path))
        except Exception as exc:  # keep the old fleet on a bad edit
            logger.warning("fleet: ignoring invalid %s: %s", self.path, exc)
            return None
        self._mtime = mtime
        return configs

    async def close(self) -> None:
        return None


class KubernetesSource:
    """Ready pods matching a label selector, read from the Kubernetes API."""

    def __init__(self, config: KubernetesConfig):
        self.config = config
        self.name = f"kubernetes:{config.namespace}/{config.label_selector}"
        server = config.api_server or _in_cluster_server()
        verify: Any = True
        if server.startswith("https://") and config.ca_file and config.ca_file.is_file():
            verify = str(config.ca_file)
        self._client = httpx.AsyncClient(
            base_url=server, verify=verify, timeout=5.0, trust_env=False
        )
        self._next = 0.0

    def _headers(self) -> dict[str, str]:
        path = self.config.token_file
        if path and path.is_file():  # re-read: projected tokens rotate
            return {"Authorization": f"Bearer {path.read_text().strip()}"}
        return {}

    async def fetch(self) -> list[InstanceConfig] | None:
        now = time.monotonic()
        if now < self._next:
            return None
        self._next = now + self.config.poll_interval_s
        cfg = self.config
        try:
            resp = await self._client.get(
                f"/api/v1/namespaces/{cfg.namespace}/pods",
                params={"labelSelector": cfg.label_selector},
                headers=self._headers(),
            )
            resp.raise_for_status()
            pods = resp.json().get("items", [])
        except (httpx.HTTPError, ValueError) as exc:
            logger.warning("fleet: kubernetes list failed (%s); keeping the last fleet", exc)
            return None
        return [inst for pod in pods if (inst := self._instance(pod)) is not None]

    def _instance(self, pod: dict) -> InstanceConfig | None:
        meta, status = pod.get("metadata", {}), pod.get("status", {})
        name = meta.get("name", "?")
        if meta.get("deletionTimestamp") or status.get("phase") != "Running":
            return None
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions", [])
        )
        ip = status.get("podIP")
        if not ready or not ip:
            return None
        role = (meta.get("labels") or {}).get(self.config.role_label, "both")
        if role not in ROLES:
            logger.warning("fleet: pod %s has unknown role %r; skipped", name, role)
            return None
        annotations = meta.get("annotations") or {}
        port = _port(annotations.get(self.config.port_annotation), self.config.port)
        if port is None:
            logger.warning(
                "fleet: pod %s: annotation %s is not a port (1-65535); skipped",
                name,
                self.config.port_annotation,
            )
            return None
        try:
            address = ipaddress.ip_address(ip)
        except ValueError:
            logger.warning("fleet: pod %s: podIP %r is not an IP address; skipped", name, ip)
            return None
        host = f"[{address}]" if address.version == 6 else str(address)
        return InstanceConfig(
            url=f"{self.config.scheme}://{host}:{port}",
            role=role,
            name=f"{self.config.namespace}/{name}",
            kv_events=self._kv_events(name, annotations, host),
        )

    def _kv_events(self, name: str, annotations: dict, host: str) -> KVEventsConfig | None:
        """Where the pod publishes its KV events, from its annotations; None when it does not
        say, or says it in a way that is not a port or a topic (the pod is then routed on the
        estimate, with a warning: it still serves)."""
        cfg = self.config
        if cfg.kv_events_port_annotation not in annotations:
            return None
        port = _port(annotations[cfg.kv_events_port_annotation], 0)
        replay = annotations.get(cfg.kv_events_replay_port_annotation)
        replay_port = None if replay is None else _port(replay, 0)
        topic = annotations.get(cfg.kv_events_topic_annotation, "")
        if port is None or (replay is not None and replay_port is None):
            logger.warning(
                "fleet: pod %s: a KV events port annotation is not a port (1-65535); "
                "its KV events are not followed",
                name,
            )
            return None
        if not isinstance(topic, str) or not re.fullmatch(r"[\x21-\x7e]{0,256}", topic):
            logger.warning(
                "fleet: pod %s: annotation %s is not a topic (up to 256 printable ASCII "
                "characters, no spaces); its KV events are not followed",
                name,
                cfg.kv_events_topic_annotation,
            )
            return None
        return KVEventsConfig(
            endpoint=f"tcp://{host}:{port}",
            replay_endpoint=None if replay_port is None else f"tcp://{host}:{replay_port}",
            topic=topic,
        )

    async def close(self) -> None:
        await self._client.aclose()


def _port(value: object, default: int) -> int | None:
    """A pod's port annotation as a port number (absent: ``default``); None unless it is an
    integer 1-65535 written in ASCII digits and nothing else (it becomes part of a URL)."""
    if value is None:
        return default
    if isinstance(value, str) and re.fullmatch(r"[0-9]{1,5}", value):
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 65535:
        return value
    return None


def _in_cluster_server() -> str:
    host = os.environ.get("KUBERNETES_SERVICE_HOST")
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise ValueError("kubernetes.api_server is not set and KUBERNETES_SERVICE_HOST is unset")
    return f"https://{host}:{port}"
