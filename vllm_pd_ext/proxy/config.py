"""The proxy's settings: one pydantic model, validated once, loadable from a file and flags."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from vllm_pd_ext.proxy.policies import POLICIES, ScoringConfig
from vllm_pd_ext.proxy.protocols import PROTOCOLS, make_protocol, split_host_port
from vllm_pd_ext.util.config_file import read_mapping

Role = Literal["prefill", "decode", "both"]


def _http_url(value: str, what: str) -> str:
    value = value.rstrip("/")
    if not value.startswith(("http://", "https://")):
        raise ValueError(f"{what} must start with http:// or https://: {value!r}")
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class KVEventsConfig(_Strict):
    """Where an engine publishes its KV events (vLLM's ``--kv-events-config`` with
    ``"enable_kv_cache_events": true, "publisher": "zmq"``): the proxy subscribes and keeps an
    index of the prefixes the engine's cache holds (``kv_events.py``)."""

    endpoint: str = Field(
        description="the engine's ZeroMQ publisher: tcp://host:port or ipc:///path (vLLM binds "
        "it for a wildcard host such as tcp://*:5557 and for ipc://; keep it on a private "
        "network or use ipc:// on one host: the events are not authenticated)"
    )
    replay_endpoint: str | None = Field(
        None, description="its replay endpoint, for what was stored before and gaps"
    )
    topic: str = ""

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _zmq(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("tcp://", "ipc://")):
            raise ValueError(f"{value!r}: a tcp:// or ipc:// ZeroMQ endpoint")
        return value


class InstanceConfig(_Strict):
    """One engine: its base URL and role."""

    url: str
    role: Role = "both"
    name: str | None = None
    engine_id: str | None = Field(
        None, description="the engine's kv engine_id (mooncake; moriio-write, pdext-write)"
    )
    bootstrap_addr: str | None = Field(
        None,
        description="host:port of the engine's KV side channel: mooncake's bootstrap server, "
        "MoRI-IO's handshake port (moriio-write), our connector's side channel (pdext-write)",
    )
    notify_port: int | None = Field(
        None, ge=1, le=65535, description="MoRI-IO's notify port (moriio-write)"
    )
    kv_events: KVEventsConfig | None = None

    @field_validator("bootstrap_addr")
    @classmethod
    def _addr(cls, value: str | None) -> str | None:
        if value is not None:
            split_host_port(value)
        return value

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        return _http_url(value, "instance url")

    @property
    def label(self) -> str:
        return self.name or self.url


class KubernetesConfig(_Strict):
    """Discover instances as the Ready pods matching a label selector.

    A pod's role comes from its ``role_label`` (prefill, decode or both; absent = both), its
    port from ``port_annotation`` or ``port``. A pod annotated with ``kv_events_port_annotation``
    publishes its KV events at ``tcp://<podIP>:<port>`` (replays at the port in
    ``kv_events_replay_port_annotation``, topic in ``kv_events_topic_annotation``): the proxy
    follows them as it does an instance's ``kv_events``. The API server defaults to the
    in-cluster one, with the pod's service-account token and CA.
    """

    api_server: str | None = Field(
        None, description="default: https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT"
    )
    namespace: str = "default"
    label_selector: str
    role_label: str = "vllm-pd.io/role"
    port: int = Field(8000, ge=1, le=65535)
    port_annotation: str = "vllm-pd.io/port"
    kv_events_port_annotation: str = "vllm-pd.io/kv-events-port"
    kv_events_replay_port_annotation: str = "vllm-pd.io/kv-events-replay-port"
    kv_events_topic_annotation: str = "vllm-pd.io/kv-events-topic"
    scheme: Literal["http", "https"] = "http"
    token_file: Path | None = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
    ca_file: Path | None = Path("/var/run/secrets/kubernetes.io/serviceaccount/ca.crt")
    poll_interval_s: float = Field(5.0, gt=0)


class DecisionConfig(_Strict):
    """When to split a request across prefill and decode, and when to serve it colocated."""

    min_split_prompt_tokens: int = Field(
        256, ge=0, description="estimated prompt tokens below which a request runs colocated"
    )
    chars_per_token: float = Field(
        4.0, gt=0, description="text prompts: characters per token for the length estimate"
    )
    max_prefill_waiting: int = Field(
        8, ge=1, description="colocate when every healthy prefill has this many queued requests"
    )
    cost_model: bool = Field(
        True,
        description="colocate when the measured KV transfer cost exceeds the predicted "
        "stall that prefilling on the decode instance would cause its running requests",
    )
    cost_min_samples: int = Field(5, ge=1, description="measurements before the cost model acts")
    decode_room: Literal["colocated", "wait", "off"] = Field(
        "colocated",
        description="a split whose prompt's KV does not fit in the chosen decode instance's "
        "free KV blocks (its cache size and usage from its /metrics, less the splits routed "
        "there since): served colocated there (no prefill's KV is held for a decode that "
        "cannot take it), or waits for room for up to decode_room_wait_s (then colocated), "
        "or is split anyway (off)",
    )
    decode_room_wait_s: float = Field(
        5.0, gt=0, description="decode_room wait: the longest a split waits for decode room"
    )


class StallGuardConfig(_Strict):
    """A split request's first token must arrive within a deadline after its prefill leg, else
    it is served colocated (``stall_guard.py``)."""

    enabled: bool = True
    non_streamed: bool = Field(
        True,
        description="guard non-streamed splits too: their decode leg first asks for one token "
        "(the KV load, under the deadline), then for the whole answer from the same instance, "
        "whose prefix cache then holds the prompt (one more engine step; prefix caching must "
        "be on in decode instances, as it is by default)",
    )
    stalled_on: Literal["prefill", "decode"] = Field(
        "prefill",
        description="where a stalled request is served colocated: the prefill instance that "
        "just computed its prompt (its prefix cache holds it; the decode that stalled may be "
        "wedged), or the decode instance; the others are tried after it",
    )
    floor_s: float = Field(
        2.0,
        gt=0,
        description="least time from the prefill leg's end to the decode leg's first token, "
        "the decode's queueing included (set it above the transfer time of your longest "
        "prompts)",
    )
    factor: float = Field(
        4.0,
        ge=1,
        description="the deadline is this many times the transfer the cost model expects for "
        "the prompt (once it has measured cost_min_samples splits), if more than floor_s",
    )
    hedge: bool = Field(
        True,
        description="streams: once a guarded split has run hedge_factor x its typical split "
        "(measured prefill leg + transfer gap) plus hedge_margin_s (hedge_unmeasured_s until "
        "measured) without a first token, start the request colocated beside it and keep "
        "whichever answers first; the deadlines stay as the hard stop behind it",
    )
    hedge_factor: float = Field(
        1.5, ge=1, description="a split is late, and hedged, past this many times its typical"
    )
    hedge_margin_s: float = Field(0.05, ge=0, description="seconds added to the hedge's delay")
    hedge_min_s: float = Field(
        0.5,
        ge=0,
        description="the hedge's delay is at least this: a hedge costs a whole colocated "
        "prefill on another instance, worth it for a stalled split, not for a slightly slow one",
    )
    hedge_unmeasured_s: float = Field(
        0.5,
        gt=0,
        description="the hedge's delay until the cost model has measured cost_min_samples "
        "splits (about a colocated answer's time)",
    )
    hedge_max_in_flight: int = Field(
        4,
        ge=1,
        description="hedged requests (two legs running) at most; a late split beyond this "
        "waits for its deadline alone, so a loaded fleet does not double its work",
    )
    breaker_stalls: int = Field(
        3, ge=1, description="stalls in a row on one prefill-decode pair that stop its splits"
    )
    breaker_open_s: float = Field(
        30.0, gt=0, description="how long a pair gets no splits; then one split probes it"
    )
    breaker_max_open_s: float = Field(
        300.0,
        gt=0,
        description="a probe that stalls again doubles the time, up to this; a pair whose "
        "breaker a probe closed is remembered this long (a stall then opens it again at once, "
        "for twice as long)",
    )


class TimeoutConfig(_Strict):
    connect_s: float = Field(3.0, gt=0)
    prefill_s: float = Field(120.0, gt=0, description="whole prefill leg")
    decode_first_byte_s: float = Field(120.0, gt=0, description="decode leg until its headers")
    decode_idle_s: float = Field(120.0, gt=0, description="longest gap between decode chunks")
    health_s: float = Field(5.0, gt=0)
    drain_s: float = Field(60.0, gt=0, description="background drain of an abandoned split")
    render_s: float = Field(30.0, gt=0, description="one render or derender call (token mode)")


class ProxyConfig(_Strict):
    """Everything ``vllm-pd proxy`` needs. Unknown keys are errors."""

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    protocol: str = Field(
        "nixl-pull",
        description="P/D protocol: how the legs are sequenced and what their "
        "kv_transfer_params carry (see proxy/protocols.py): " + ", ".join(PROTOCOLS),
    )
    instances: tuple[InstanceConfig, ...] = ()
    instances_file: Path | None = Field(
        None, description="JSON/YAML file with an `instances` list, re-read when it changes"
    )
    kubernetes: KubernetesConfig | None = None
    render: tuple[str, ...] = Field(
        (),
        description="token mode: render server URLs (`vllm-pd render`, `vllm launch render`); "
        "engines then get token ids on /inference/v1/generate (`vllm serve --enable-scale-out` "
        "or `--tokens-only`). Empty: text mode (OpenAI requests forwarded as they are)",
    )
    tokenizer: Path | None = Field(
        None,
        description="text mode: a directory holding the served model's tokenizer.json; a text "
        "completion's prompt is then tokenized here (special tokens added, as vLLM does) to "
        "look it up in the engines' prefix indexes (KV events). Without it text prompts are "
        "routed on the estimate; chat in text mode always is (its template is the engine's)",
    )
    prefill_policy: str = "least-loaded"
    decode_policy: str = "least-loaded"
    scoring: ScoringConfig = Field(
        ScoringConfig(), description="the weights of the cache-aware policy"
    )
    client_kv_transfer_params: Literal["drop", "reject"] = "drop"
    on_prefill_failure: Literal["retry-then-colocated", "retry-then-fail"] = "retry-then-colocated"
    no_decode_fallback: bool = Field(
        True,
        description="with no healthy decode instance, serve requests whole on a healthy "
        'prefill instance (counted in vllm_pd_fallbacks_total{reason="no_decode"}) '
        "instead of answering 503",
    )
    prefill_retries: int = Field(1, ge=0, description="other prefill instances tried")
    decode_retries: int = Field(1, ge=0, description="other decode instances tried (pre-stream)")
    max_migrations: int = Field(
        1,
        ge=0,
        description="times one answer whose engine fails part-way is moved to another "
        "instance (a stream continued where it broke, a whole answer asked again); 0: a "
        "stream that breaks ends with an SSE error event (proxy/migration.py)",
    )
    max_in_flight: int = Field(256, ge=1)
    max_queued: int = Field(512, ge=0)
    queue_timeout_s: float = Field(30.0, gt=0)
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    max_buffered_body_bytes: int = Field(
        1 << 30,
        ge=1024,
        description="request bodies held at once over all connections; a request whose body "
        "would pass it is answered 503 and its connection closed",
    )
    max_connections: int = Field(
        2048, ge=1, description="client connections at once; beyond them, requests get 503"
    )
    client_header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="a request's head must arrive within this (from the connection or the "
        "request's first byte), else the connection is closed",
    )
    client_body_timeout_s: float = Field(
        60.0,
        gt=0,
        description="a request's body must arrive within this after its head, else the "
        "completion routes answer 408 and the connection is closed",
    )
    fast_path: bool = Field(
        True,
        description="serve the completion routes through the proxy's lean HTTP request cycle "
        "(built on uvicorn internals, checked at start-up; falls back to uvicorn's own cycle "
        "when they are missing). false: uvicorn's own cycle, within the same client limits "
        "(proxy/client_limits.py, public interfaces only)",
    )
    health_interval_s: float = Field(2.0, gt=0)
    health_backoff_max_s: float = Field(30.0, gt=0)
    unhealthy_after: int = Field(
        3, ge=1, description="failed health checks in a row (not refusals) before ejecting"
    )
    api_key: SecretStr | None = None
    admin_token: SecretStr | None = None
    render_api_key: SecretStr | None = Field(
        None, description="token mode: the render servers' API key (sent as a bearer token)"
    )
    metrics_token: SecretStr | None = Field(
        None,
        description="bearer token for /metrics and /health's detail; unset: api_key's when "
        "that is set, else both are open",
    )

    def monitor_secret(self) -> str | None:
        """The bearer token /metrics and /health's detail need (None: open)."""
        secret = self.metrics_token or self.api_key
        return secret.get_secret_value() if secret is not None else None

    otlp_traces_endpoint: str | None = Field(
        None,
        description="OpenTelemetry collector for the proxy's traces (one per request, a span "
        "per stage and leg; proxy/tracing.py), as vLLM's flag of the same name: gRPC unless "
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf; engines get each leg's "
        "traceparent. Needs the otel extra. Unset: no tracing, at no cost",
    )

    affinity_prefix_chars: int = Field(1024, ge=16, description="prefix-affinity key length")
    decision: DecisionConfig = DecisionConfig()
    stall_guard: StallGuardConfig = StallGuardConfig()
    timeouts: TimeoutConfig = TimeoutConfig()

    @field_validator("render")
    @classmethod
    def _render_urls(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(_http_url(u, "render url") for u in value)

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_file(cls, value: Path | None) -> Path | None:
        if value is not None and not (value / "tokenizer.json").is_file():
            raise ValueError(f"tokenizer: no tokenizer.json in {value}")
        return value

    @property
    def token_mode(self) -> bool:
        return bool(self.render)

    @model_validator(mode="after")
    def _fleet(self) -> ProxyConfig:
        if not self.instances and self.instances_file is None and self.kubernetes is None:
            raise ValueError("no instances: give `instances`, `instances_file` or `kubernetes`")
        protocol = make_protocol(self.protocol)
        lacking = [
            f"{i.label} needs {' and '.join(fields)}"
            for i in self.instances
            if (fields := protocol.missing(i))
        ]
        if lacking:
            raise ValueError(f"protocol {self.protocol}: " + "; ".join(lacking))
        for field in ("prefill_policy", "decode_policy"):
            if getattr(self, field) not in POLICIES:
                raise ValueError(
                    f"{field}: unknown policy {getattr(self, field)!r}; "
                    f"choose one of {', '.join(sorted(POLICIES))}"
                )
        return self


def read_instances(path: Path) -> tuple[InstanceConfig, ...]:
    """The ``instances`` list of a watched fleet file."""
    data = read_mapping(path)
    return tuple(InstanceConfig.model_validate(item) for item in data.get("instances", []))
