"""``vllm-pd up``: start, supervise and stop a local P/D stack with one command.

Starts N prefill and M decode ``vllm serve`` instances with the chosen connector's
``--kv-transfer-config`` (and, in token mode, K render servers, with the engines on
``--enable-scale-out``), then the proxy in front of them; shows progress until every part is
healthy; prints the endpoint; restarts a part that dies (a bounded number of times); and on
Ctrl-C (SIGINT) or SIGTERM stops everything it started, proxy first.

Connectors: ``pdext`` (our PdExtMoRIIOConnector, READ mode by default, proxy protocol
``pdext-read``; ``pdext_mode`` write: ``pdext-write``) over one of our transport's backends
(``PDEXT_BACKENDS``), and ``nixl`` (vLLM's NixlConnector, protocol ``nixl-pull``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from vllm_pd_ext import fleet_key
from vllm_pd_ext.util.busy_threads import summary
from vllm_pd_ext.util.logs import LogFormat, json_line
from vllm_pd_ext.util.tiny_model import MODELS, ensure_model
from vllm_pd_ext.util.vllm_process import (
    VllmServer,
    die_with_parent_preexec,
    free_port,
    start_vllm_serve,
)

logger = logging.getLogger(__name__)

#: The proxy's P/D protocol per connector name (``pdext``: in its default mode, READ).
PROTOCOLS: dict[str, str] = {"nixl": "nixl-pull", "pdext": "pdext-read"}
#: Where ``up``'s TP sizes may differ, as the connectors' README states the matrix.
TP_MATRIX = (
    "connector pdext moves KV (pdext_mode read or write) between any TP sizes that divide the "
    "model's KV heads; nixl pairs different sizes (vllm_pd_ext/connectors/README.md, "
    "supported matrix)"
)
#: Our connector's transport backends that ``up`` runs, with their settings on one host:
#: ``tcp``, our own data path (sockets; with the fleet key it serves only key holders),
#: ``cma``, the same with payloads copied by cross-memory attach between the engines (one
#: host; host memory), and ``mooncake``, the Mooncake transfer engine over its TCP transport
#: (RDMA on GPU hosts).
#: Connectors whose engines keep a thread polling while idle (NIXL's progress thread), and
#: how many samples ``up`` takes to find it before giving up.
NIXL_CONNECTOR = "NixlConnector"
POLLING_CONNECTORS = frozenset({NIXL_CONNECTOR})
POLLER_SAMPLES = 3
PDEXT_BACKENDS: dict[str, dict[str, Any]] = {
    "tcp": {"host": "127.0.0.1"},
    "cma": {"host": "127.0.0.1"},
    "mooncake": {"protocol": "tcp", "host": "127.0.0.1"},
}


def kv_transfer_config(
    connector: str,
    role: str,
    device: str,
    side_port: int,
    pdext_backend: str,
    pdext_mode: str = "read",
) -> dict:
    """``--kv-transfer-config`` of one engine; ``side_port`` is its KV side channel,
    ``pdext_backend`` and ``pdext_mode`` the transport backend and transfer mode of our
    connector (``nixl`` ignores them)."""
    if connector == "nixl":
        kv: dict[str, Any] = {
            "kv_connector": NIXL_CONNECTOR,
            "kv_role": "kv_both",
            # A failed handshake or read (a loaded host) recomputes instead of failing.
            "kv_load_failure_policy": "recompute",
        }
        if device == "cpu":
            kv["kv_buffer_device"] = "cpu"
        return kv
    return {
        "kv_connector": "PdExtMoRIIOConnector",
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "backend": pdext_backend,
            "transfer_mode": pdext_mode,
            "backend_settings": dict(PDEXT_BACKENDS[pdext_backend]),
            "side_channel_host": "127.0.0.1",
            "side_channel_port": side_port,
        },
    }


def with_tiered_cache(kv: dict, flexkv: dict[str, Any]) -> dict:
    """``kv`` (a P/D connector's config) inside MultiConnector, PdExtFlexKVConnector second."""
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "connectors": [
                kv,
                {
                    "kv_connector": "PdExtFlexKVConnector",
                    "kv_role": "kv_both",
                    "kv_load_failure_policy": "recompute",
                    "kv_connector_extra_config": dict(flexkv),
                },
            ]
        },
    }


def kv_events_config(run_dir: Path, name: str) -> dict[str, Any]:
    """``--kv-events-config`` of engine ``name`` (vLLM's ``KVEventsConfig``): its publisher
    and replay sockets in the stack's private ``run_dir``, topic ``name``."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"ipc://{run_dir / name}.pub",
        "replay_endpoint": f"ipc://{run_dir / name}.replay",
        "topic": name,
    }


def kv_events_missing() -> str | None:
    """What the proxy lacks to follow KV events (the ``kv-events`` extra), or None."""
    import importlib.util

    lacking = [m for m in ("zmq", "msgspec") if importlib.util.find_spec(m) is None]
    return " and ".join(lacking) or None


def _one_of(what: str, value: str, names: dict[str, Any]) -> str:
    if value not in names:
        raise ValueError(f"unknown {what} {value!r}; choose one of {', '.join(names)}")
    return value


class UpConfig(BaseModel):
    """What ``vllm-pd up`` brings up. Unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field("tiny-llama", description="tiny-llama, tiny-qwen, or a model dir/name")
    prefill: int = Field(1, ge=0, le=64)
    decode: int = Field(1, ge=1, le=64)
    prefill_tp: int = Field(
        1,
        ge=1,
        le=16,
        description="tensor-parallel ranks per prefill instance (--tensor-parallel-size); "
        "device cpu: one core per rank",
    )
    decode_tp: int = Field(1, ge=1, le=16, description="tensor-parallel ranks per decode instance")
    connector: str = Field(
        "pdext",
        description="one of PROTOCOLS: pdext, our PdExtMoRIIOConnector; nixl, vLLM's NixlConnector",
    )
    pdext_backend: str = Field(
        "tcp",
        description="one of PDEXT_BACKENDS: the transport of connector pdext (tcp: within "
        "noise of mooncake end to end in benchmarks/pd_backends.py, with nothing to install "
        "and every connection checked against the fleet key)",
    )
    pdext_mode: Literal["read", "write"] = Field(
        "read",
        description="transfer mode of connector pdext: read (the decode pulls) or write (the "
        "prefill pushes); both between engines of any TP sizes that divide the KV heads",
    )
    mode: Literal["text", "token"] = Field(
        "text",
        description="token: render servers in front, engines on --enable-scale-out see "
        "token ids only",
    )
    render: int = Field(1, ge=1, le=16, description="render servers (token mode)")
    flexkv: dict[str, Any] | None = Field(
        None,
        description="tiered KV cache next to the P/D connector: PdExtFlexKVConnector's "
        "kv_connector_extra_config; the engines then run MultiConnector [P/D, FlexKV]",
    )
    mooncake_master: bool = Field(
        False,
        description="start a mooncake_master for the stack (listening on 127.0.0.1 only) and "
        "give every engine's tiered cache (flexkv) a remote tier on it: a prefix one engine "
        "computed loads on the others from it; needs flexkv (without a remote of its own) "
        "and the mooncake-cpu extra",
    )
    device: Literal["cpu", "cuda"] = "cpu"
    gpus: tuple[str, ...] = Field(
        (), description="CUDA_VISIBLE_DEVICES per instance, prefill first then decode"
    )
    host: str = "127.0.0.1"
    proxy_port: int = Field(8000, ge=1, le=65535)
    max_model_len: int | None = 512
    vllm_args: tuple[str, ...] = ()
    min_split_prompt_tokens: int = Field(256, ge=0)
    cost_model: bool = True
    log_dir: Path = Path("logs/up")
    log_format: LogFormat = Field(
        "text",
        description="json: up's own lines, the proxy's and the render servers' as one JSON "
        "object per line (request lines with their request id and trace id); the engines "
        "log as vLLM does",
    )
    otlp_traces_endpoint: str | None = Field(
        None,
        description="OpenTelemetry collector for traces: the proxy's (a span per stage and "
        "leg) and the engines' (vLLM's --otlp-traces-endpoint), joined in one trace per "
        "request; needs the otel extra",
    )
    ready_timeout_s: float = Field(600, gt=0)
    calm_idle_pollers: bool = Field(
        True,
        description="device cpu: once an engine is healthy, lower the CPU priority of its "
        "threads that poll while it is idle (NIXL's progress thread), so they do not slow "
        "the cores the engines compute on",
    )
    max_restarts: int = Field(3, ge=0)
    kv_events: bool = Field(
        True,
        description="engines publish their KV cache events (--kv-events-config, ZeroMQ over "
        "ipc sockets in the stack's private run directory) and the proxy routes on what each "
        "engine's prefix cache holds; needs the kv-events extra (pyzmq, msgspec), else the "
        "stack says so and routes on the estimate",
    )

    @field_validator("connector")
    @classmethod
    def _connector(cls, value: str) -> str:
        return _one_of("connector", value, PROTOCOLS)

    @field_validator("pdext_backend")
    @classmethod
    def _pdext_backend(cls, value: str) -> str:
        return _one_of("pdext_backend", value, PDEXT_BACKENDS)

    @property
    def protocol(self) -> str:
        """The proxy's P/D protocol for the stack's connector (and, for pdext, its mode)."""
        if self.connector == "pdext":
            return f"pdext-{self.pdext_mode}"
        return PROTOCOLS[self.connector]

    @property
    def connector_label(self) -> str:
        """The connector as ``up`` names it to the user: ``pdext over tcp``, ``nixl``."""
        if self.connector == "pdext":
            return f"pdext over {self.pdext_backend}"
        return self.connector

    @model_validator(mode="after")
    def _gpus(self) -> UpConfig:
        if self.kv_events:
            for flag in ("--kv-events-config", "--no-enable-prefix-caching"):
                if any(a.split("=")[0] == flag for a in self.vllm_args):
                    raise ValueError(
                        f"vllm_args has {flag}: set kv_events: false (up starts the engines' "
                        "KV events itself, and they need prefix caching)"
                    )
        if self.flexkv is not None:
            from vllm_pd_ext.connectors.flexkv.config import FlexKVConfig

            FlexKVConfig.model_validate(self.flexkv)
        if self.mooncake_master and (self.flexkv is None or "remote" in self.flexkv):
            raise ValueError(
                "mooncake_master needs flexkv without a remote of its own (the stack's "
                "master becomes every engine's remote tier)"
            )
        if self.device == "cuda" and self.gpus and len(self.gpus) != self.prefill + self.decode:
            raise ValueError(
                f"gpus lists {len(self.gpus)} entries for {self.prefill + self.decode} instances"
            )
        self._tensor_parallel()
        return self

    def _tensor_parallel(self) -> None:
        """TP sizes the connector can pair, on devices enough for every rank."""
        if self.prefill and self.connector == "pdext":
            from vllm_pd_ext.connectors.common.parallel import tp_refusal

            refusal = tp_refusal(self.prefill_tp, self.decode_tp, mode=self.pdext_mode)
            if refusal is not None:
                raise ValueError(f"prefill_tp and decode_tp: {refusal}. Supported: {TP_MATRIX}")
        if self.device == "cuda":
            for i, devices in enumerate(self.gpus):
                tp = self.prefill_tp if i < self.prefill else self.decode_tp
                if len(devices.split(",")) != tp:
                    raise ValueError(
                        f"gpus entry {i} ({devices!r}) names {len(devices.split(','))} "
                        f"device(s) for an instance of {tp} TP rank(s)"
                    )
            return
        ranks = self.prefill * self.prefill_tp + self.decode * self.decode_tp
        cores = os.cpu_count() or 1
        if max(self.prefill_tp, self.decode_tp) > 1 and ranks > cores:
            raise ValueError(
                f"{ranks} TP ranks on {cores} cores: on cpu each rank computes on a core of "
                "its own; use fewer instances or ranks"
            )


@dataclass
class Part:
    """One supervised process: an engine or the proxy."""

    name: str
    url: str
    start: Callable[[], Any]  # -> a handle with .proc and .stop()
    handle: Any = None
    restarts: int = 0
    healthy: bool = False
    started_at: float = field(default_factory=time.monotonic)
    side_port: int | None = None  # engines: the KV side channel
    kv_transfer_config: dict[str, Any] | None = None  # engines: their --kv-transfer-config
    kv_events: dict[str, Any] | None = None  # engines: their --kv-events-config
    engine_args: list[str] = field(default_factory=list)  # engines: up's vllm serve arguments
    cpu_cores: tuple[int, ...] | None = None  # engines on cpu: a core per TP rank
    calm: bool = False  # lower the priority of its idle pollers once healthy
    calmed: bool = False  # done for the running process

    @property
    def proc(self) -> subprocess.Popen:
        return self.handle.proc


class ToolProcess:
    """A ``vllm-pd`` subcommand (proxy, render) as a child process with the same stop()
    contract as VllmServer."""

    def __init__(
        self, command: str, args: list[str], log_path: Path, env: dict[str, str] | None = None
    ):
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "vllm_pd_ext.cli", command, *args],
                env={**os.environ, **(env or {})},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent_preexec,
            )

    def stop(self, grace: float = 10.0) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=5)


class Stack:
    """The parts of one stack, started in order and stopped in reverse."""

    def __init__(self, config: UpConfig, out=sys.stderr):
        self.config = config
        self.out = out
        self.parts: list[Part] = []
        self._stop = threading.Event()
        self.model_dir: str = ""
        self.served_name: str = ""
        #: The engines' fleet-key environment, and the private directory of a generated key.
        self.key_env: dict[str, str] = {}
        self.key_dir: Path | None = None
        self.key_source = ""  # where the key came from, for the log
        #: Private (0700) directory of the engines' KV events sockets, removed at stop.
        self.run_dir: Path | None = None
        #: Why the engines run without KV events although ``kv_events`` asks for them.
        self.no_events = ""
        #: The tiered cache's config for every engine (``flexkv``, with the stack's master as
        #: the remote tier when ``mooncake_master``), and that master's port.
        self.flexkv: dict[str, Any] | None = None
        self.master_port: int | None = None
        self._services = contextlib.ExitStack()  # the master, stopped after the engines

    # -- building ----------------------------------------------------------------------

    def _engine_part(self, role: str, index: int, port: int, slot: int, core: int) -> Part:
        """Engine ``index`` of ``role``: instance ``slot`` of the stack (its ``gpus`` entry),
        its ranks on the cores from ``core`` on (device cpu)."""
        cfg = self.config
        side_port = free_port()
        kv = kv_transfer_config(
            cfg.connector, role, cfg.device, side_port, cfg.pdext_backend, cfg.pdext_mode
        )
        if self.flexkv is not None:
            kv = with_tiered_cache(kv, self.flexkv)
        env = {
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port),
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            **self.key_env,
        }
        tp = cfg.prefill_tp if role == "prefill" else cfg.decode_tp
        cpu_cores: tuple[int, ...] | None = None
        if cfg.device == "cuda":
            if cfg.gpus:
                env["CUDA_VISIBLE_DEVICES"] = cfg.gpus[slot]
        else:
            ncpu = max(1, os.cpu_count() or 1)
            cpu_cores = tuple((core + rank) % ncpu for rank in range(tp))
        extra = list(cfg.vllm_args)
        if tp > 1:
            extra += ["--tensor-parallel-size", str(tp)]
        if cfg.mode == "token":
            extra.append("--enable-scale-out")
        if cfg.otlp_traces_endpoint:
            extra += ["--otlp-traces-endpoint", cfg.otlp_traces_endpoint]
        base = ["--enforce-eager"] if cfg.device == "cpu" else []
        if cfg.max_model_len:
            base += ["--max-model-len", str(cfg.max_model_len)]
        name = f"{role}-{index}"
        events = None
        if self.run_dir is not None:
            events = kv_events_config(self.run_dir, name)
            extra += ["--kv-events-config", json.dumps(events)]

        def start() -> VllmServer:
            return start_vllm_serve(
                self.model_dir,
                log_path=cfg.log_dir / f"{name}.log",
                port=port,
                cpu_core=cpu_cores,
                kv_transfer_config=kv,
                env=env,
                extra_args=extra,
                base_args=base,
                served_name=self.served_name,
                device=cfg.device,
                die_with_parent=True,
            )

        part = Part(name=name, url=f"http://127.0.0.1:{port}", start=start)
        part.side_port = side_port
        part.kv_transfer_config = kv
        part.kv_events = events
        part.engine_args = extra
        part.cpu_cores = cpu_cores
        part.calm = cfg.device == "cpu" and cfg.calm_idle_pollers
        return part

    def _render_part(self, index: int, port: int) -> Part:
        cfg = self.config
        args = [self.model_dir, "--host", "127.0.0.1", "--port", str(port)]
        args += ["--served-model-name", self.served_name, "--log-format", cfg.log_format]
        if cfg.max_model_len:
            args += ["--max-model-len", str(cfg.max_model_len)]
        name = f"render-{index}"
        return Part(
            name=name,
            url=f"http://127.0.0.1:{port}",
            start=lambda: ToolProcess("render", args, cfg.log_dir / f"{name}.log"),
        )

    def proxy_config(self) -> dict[str, Any]:
        """The proxy's ProxyConfig (as written to ``<log_dir>/proxy.json``)."""
        cfg = self.config
        instances = []
        for part in self.parts:
            role = part.name.split("-")[0]
            if role in ("prefill", "decode"):
                inst: dict[str, Any] = {"url": part.url, "role": role, "name": part.name}
                if cfg.connector == "pdext" and role == "prefill":
                    inst["bootstrap_addr"] = f"127.0.0.1:{part.side_port}"
                if part.kv_events is not None:
                    events = part.kv_events
                    inst["kv_events"] = {
                        k: events[k] for k in ("endpoint", "replay_endpoint", "topic")
                    }
                instances.append(inst)
        config: dict[str, Any] = {
            "host": cfg.host,
            "port": cfg.proxy_port,
            "protocol": cfg.protocol,
            "instances": instances,
            "render": [p.url for p in self.parts if p.name.startswith("render")],
            "decision": {
                "min_split_prompt_tokens": cfg.min_split_prompt_tokens,
                "cost_model": cfg.cost_model,
            },
        }
        if self.run_dir is not None:  # the engines publish KV events: route on them
            config["prefill_policy"] = config["decode_policy"] = "cache-aware"
            if not config["render"] and (Path(self.model_dir) / "tokenizer.json").is_file():
                config["tokenizer"] = self.model_dir  # text prompts looked up by their ids
        if cfg.otlp_traces_endpoint:
            config["otlp_traces_endpoint"] = cfg.otlp_traces_endpoint
        return config

    def _check_tp_heads(self, local: Path) -> None:
        """Prefill and decode TP sizes that differ against the model's KV heads (its local
        config.json; a hub name is checked by the engines at their first handshake):
        ValueError when no KV could move between them."""
        from vllm_pd_ext.connectors.common.parallel import tp_refusal

        cfg = self.config
        if not (cfg.prefill and cfg.connector == "pdext" and cfg.prefill_tp != cfg.decode_tp):
            return
        try:
            model = json.loads((local / "config.json").read_text())
        except (OSError, ValueError):
            return
        heads = model.get("num_key_value_heads", model.get("num_attention_heads"))
        if not isinstance(heads, int):
            return
        refusal = tp_refusal(cfg.prefill_tp, cfg.decode_tp, mode=cfg.pdext_mode, kv_heads=heads)
        if refusal is not None:
            raise ValueError(f"prefill_tp and decode_tp: {refusal}. Supported: {TP_MATRIX}")

    def build(self) -> None:
        cfg = self.config
        self.model_dir = str(ensure_model(cfg.model)) if cfg.model in MODELS else cfg.model
        local = Path(self.model_dir)
        self.served_name = local.name if local.is_dir() else self.model_dir
        self._check_tp_heads(local)
        self.key_env = self._fleet_key()
        if cfg.kv_events:
            missing = kv_events_missing()
            if missing is None:
                self.run_dir = Path(tempfile.mkdtemp(prefix="vllm-pd-run-"))
            else:
                self.no_events = (
                    f"KV events off: the proxy cannot follow them without {missing} (pip "
                    "install 'vllm-pd-ext[kv-events]'); it routes on the prefix estimate"
                )
        self.flexkv = cfg.flexkv
        if cfg.mooncake_master and cfg.flexkv is not None:
            self.master_port = free_port()
            self.flexkv = {**cfg.flexkv, "remote": {"master": f"127.0.0.1:{self.master_port}"}}
        slot = core = 0
        parts: list[Part] = []
        if cfg.mode == "token":
            parts += [self._render_part(i, free_port()) for i in range(cfg.render)]
        for role, count, tp in (
            ("prefill", cfg.prefill, cfg.prefill_tp),
            ("decode", cfg.decode, cfg.decode_tp),
        ):
            for i in range(count):
                parts.append(self._engine_part(role, i, free_port(), slot, core))
                slot += 1
                core += tp
        self.parts = parts
        config_path = cfg.log_dir / "proxy.json"
        config_path.parent.mkdir(parents=True, exist_ok=True)
        config_path.write_text(json.dumps(self.proxy_config(), indent=2))
        proxy_args = ["--config", str(config_path), "--log-format", cfg.log_format]
        proxy = Part(
            name="proxy",
            url=f"http://127.0.0.1:{cfg.proxy_port}",
            start=lambda: ToolProcess("proxy", proxy_args, cfg.log_dir / "proxy.log", self.key_env),
        )
        self.parts = [*parts, proxy]

    def _fleet_key(self) -> dict[str, str]:
        """What hands the engines and the proxy the fleet key (:mod:`vllm_pd_ext.fleet_key`):
        the caller's own, checked, when set (they inherit it); else a fresh key in a private
        temporary directory, removed when the stack stops."""
        if fleet_key.load_key() is not None:
            where = os.environ.get(fleet_key.KEY_FILE_ENV) or f"${fleet_key.KEY_ENV}"
            self.key_source = f"from the caller's environment ({where})"
            return {}
        self.key_dir = Path(tempfile.mkdtemp(prefix="vllm-pd-key-"))
        path = fleet_key.write_key_file(self.key_dir / "fleet.key")
        self.key_source = (
            f"generated for this stack in {path} (removed when it stops; to add an engine, "
            f"start it with {fleet_key.KEY_FILE_ENV}={path})"
        )
        return {fleet_key.KEY_FILE_ENV: str(path)}

    # -- running -----------------------------------------------------------------------

    def _say(self, message: str) -> None:
        if self.config.log_format == "json":
            print(json_line(message, __name__), file=self.out, flush=True)
        else:
            print(f"[vllm-pd up] {message}", file=self.out, flush=True)

    def start_engines(self) -> None:
        """Start everything but the proxy: render servers (token mode) and engines."""
        for part in self.parts[:-1]:
            part.handle = part.start()
            part.started_at = time.monotonic()
        renders = sum(p.name.startswith("render") for p in self.parts)
        engines = len(self.parts) - 1 - renders
        what = f"{engines} engine(s)" + (f" and {renders} render server(s)" if renders else "")
        self._say(
            f"starting {what} ({self.config.mode} mode, connector "
            f"{self.config.connector_label}); logs in {self.config.log_dir}"
        )
        if self.config.connector == "pdext":
            from vllm_pd_ext.transport.registry import backend_class

            backend = self.config.pdext_backend
            data = (
                f"the {backend} data server serves only key holders"
                if backend_class(backend).fleet_key_scope == "all"
                else f"the {backend} data plane does not check it (it listens on 127.0.0.1)"
            )
            self._say(
                f"fleet key {self.key_source}: KV transfer params are signed and checked; {data}"
            )
        else:
            self._say(f"fleet key {self.key_source} (vLLM's NixlConnector does not use it)")
        if self.run_dir is not None:
            self._say(
                f"KV events: the engines publish them on ipc sockets in {self.run_dir}; the "
                "proxy routes on what each one's prefix cache holds"
            )
        elif self.no_events:
            self._say(self.no_events)

    def start_master(self) -> bool:
        """Start the stack's mooncake_master when ``mooncake_master`` asks for one; False
        (said why) when it cannot run."""
        if self.master_port is None:
            return True
        from vllm_pd_ext.util.mooncake_master import mooncake_master

        log = self.config.log_dir / "mooncake_master.log"
        try:
            self._services.enter_context(mooncake_master(log, rpc_port=self.master_port))
        except RuntimeError as e:
            self._say(f"cannot start the stack's mooncake_master: {e}; see {log}")
            return False
        self._say(
            f"mooncake_master on 127.0.0.1:{self.master_port} (log {log}): every engine's "
            "tiered cache has a remote tier on it"
        )
        return True

    def start_proxy(self) -> None:
        proxy = self.parts[-1]
        proxy.handle = proxy.start()
        proxy.started_at = time.monotonic()

    def start(self) -> bool:
        """Start the engines (and render servers), wait until they are healthy, then the
        proxy, and wait for it to see them all; False if a part died, time ran out or the
        stack was asked to stop. The caller stops the stack (:meth:`stop_all`) either way."""
        if not self.start_master():
            return False
        self.start_engines()
        if not self.wait_ready(self.parts[:-1]):
            return False
        self.start_proxy()
        return self.wait_ready(self.parts[-1:])

    def _check(self, part: Part) -> bool:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            resp = httpx.get(f"{part.url}/health", timeout=2.0)
            if part.name != "proxy":
                return resp.status_code == 200
            # The proxy is ready once it sees every engine healthy.
            body = resp.json()
            return (
                resp.status_code == 200
                and body.get("healthy_prefill") == self.config.prefill
                and body.get("healthy_decode") == self.config.decode
            )
        return False

    def wait_ready(self, parts: list[Part]) -> bool:
        """Poll until ``parts`` are healthy; False if one died, time ran out or we were
        stopped. Progress is printed when something changes, and every 15 s."""
        deadline = time.monotonic() + self.config.ready_timeout_s
        last, last_at = "", 0.0
        while not self._stop.is_set():
            for part in parts:
                if part.proc.poll() is not None:
                    self._say(
                        f"{part.name} exited with {part.proc.returncode} while starting; "
                        f"see {self.config.log_dir / (part.name + '.log')}"
                    )
                    return False
                if not part.healthy:
                    part.healthy = self._check(part)
            ready = [p.name for p in parts if p.healthy]
            status = f"{len(ready)}/{len(parts)} healthy" + (
                f" ({', '.join(ready)})" if ready else ""
            )
            now = time.monotonic()
            if status != last or now - last_at >= 15:
                self._say(f"waiting: {status}, {now - parts[0].started_at:.0f}s")
                last, last_at = status, now
            if len(ready) == len(parts):
                for part in parts:  # all idle now: only pollers are busy
                    self._calm(part)
                return True
            if now > deadline:
                self._say("timed out waiting for the stack to become healthy")
                return False
            self._stop.wait(1.0)
        return False

    def _calm(self, part: Part) -> None:
        """Once per process of a healthy engine part: lower its idle pollers' priority. An
        engine whose connector is known to poll (NIXL) is sampled up to ``POLLER_SAMPLES``
        times: on a loaded host one sample can miss its poller's share of a core."""
        if part.calm and not part.calmed:
            part.calmed = True
            connector = (part.kv_transfer_config or {}).get("kv_connector")
            for _ in range(POLLER_SAMPLES if connector in POLLING_CONNECTORS else 1):
                if calmed := part.handle.calm_idle_pollers():
                    self._say(f"{part.name}: {summary(calmed)}")
                    return

    def supervise(self) -> int:
        """Restart parts that exit, until stopped. Returns the exit status."""
        while not self._stop.wait(1.0):
            for part in self.parts:
                if part.handle is None:
                    continue
                if part.proc.poll() is None:
                    if part.calm and not part.calmed and self._check(part):
                        self._calm(part)
                    continue
                if part.restarts >= self.config.max_restarts:
                    self._say(
                        f"{part.name} exited with {part.proc.returncode} and has used "
                        f"its {self.config.max_restarts} restarts; stopping the stack"
                    )
                    return 1
                part.restarts += 1
                self._say(
                    f"{part.name} exited with {part.proc.returncode}; restarting "
                    f"({part.restarts}/{self.config.max_restarts})"
                )
                part.handle.stop()
                part.handle = part.start()
                part.started_at = time.monotonic()
                part.calmed = False
        return 0

    def stop_all(self) -> None:
        self._stop.set()
        for part in reversed(self.parts):  # proxy first
            if part.handle is not None:
                with contextlib.suppress(Exception):
                    part.handle.stop()
        with contextlib.suppress(Exception):
            self._services.close()
        for private in (self.key_dir, self.run_dir):
            if private is not None:
                shutil.rmtree(private, ignore_errors=True)
        self._say("stopped everything it started")

    def request_stop(self, *_args) -> None:
        self._stop.set()

    def warm_up(self, attempts: int = 3) -> None:
        """Send one request long enough to be split through the proxy before announcing the
        endpoint: the first split pays one-off connector set-up (NIXL's handshake can take
        seconds, and time out on a loaded machine), which should not land on a user."""
        if not self.config.prefill:
            return
        limit = (self.config.max_model_len or 4096) - 64
        tokens = self.config.min_split_prompt_tokens + 32
        if tokens > limit:
            return  # nothing this long is accepted, so nothing will be split
        url = f"http://{self.config.host}:{self.config.proxy_port}/v1/completions"
        body = {"model": self.served_name, "prompt": "warm up " * (tokens // 2), "max_tokens": 1}
        for attempt in range(1, attempts + 1):
            start = time.monotonic()
            try:
                resp = httpx.post(url, json=body, timeout=120)
            except httpx.HTTPError as e:
                error = str(e)
            else:
                if resp.status_code == 200:
                    took = time.monotonic() - start
                    self._say(f"warm-up request (long enough to split) served in {took:.1f}s")
                    return
                error = f"HTTP {resp.status_code}: {resp.text[:200]}"
            self._say(f"warm-up request {attempt}/{attempts} failed ({error})")
            if self._stop.is_set():
                return

    def endpoint_banner(self) -> str:
        url = f"http://{self.config.host}:{self.config.proxy_port}/v1"
        model = self.served_name
        sample = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 16})
        engines = "\n".join(f"  {p.name}: {p.url}" for p in self.parts[:-1])
        chat = json.dumps(
            {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16}
        )
        return (
            f"ready: OpenAI-compatible endpoint {url} (model {model!r}, {self.config.mode} "
            f"mode, connector {self.config.connector_label})\n{engines}\n"
            f"  try: curl -s {url}/completions -H 'Content-Type: application/json' "
            f"-d '{sample}'\n"
            f"   or: curl -s {url}/chat/completions -H 'Content-Type: application/json' "
            f"-d '{chat}'\n"
            f"  prompts under {self.config.min_split_prompt_tokens} tokens are served "
            f"colocated on a decode instance; Ctrl-C stops the stack"
        )


def run_up(config: UpConfig) -> int:
    """The ``vllm-pd up`` command: returns the exit status."""
    stack = Stack(config)
    try:
        stack.build()
    except fleet_key.FleetKeyError as e:
        print(f"vllm-pd up: fleet key: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # the model and the configuration do not fit together
        print(f"vllm-pd up: {e}", file=sys.stderr)
        stack.stop_all()
        return 2
    previous = {
        sig: signal.signal(sig, stack.request_stop) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        if not stack.start():
            return 0 if stack._stop.is_set() else 1
        stack.warm_up()
        banner = stack.endpoint_banner()
        if config.log_format == "json":
            url = f"http://{config.host}:{config.proxy_port}/v1"
            banner = json_line(banner, __name__, endpoint=url)
        print(banner, flush=True)
        return stack.supervise()
    finally:
        stack.stop_all()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
