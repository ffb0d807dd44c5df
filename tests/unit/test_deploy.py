"""deploy/: every overlay renders with kustomize (stock ``kubectl kustomize``) into manifests that
validate against the Kubernetes schemas of two versions; the manifests agree with what our parts
read (the proxy's config, its Kubernetes fleet source's labels, the connectors' config); the
proxy's Role grants exactly the API calls its fleet source makes, checked by running the real
source against a recording API server; the dashboard and alert rules are well formed."""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from tests import deploy_files
from tests.skips import MissingDependency, need
from vllm_pd_ext import fleet_key
from vllm_pd_ext.connectors.common.config import parse_transfer_config
from vllm_pd_ext.proxy.config import ProxyConfig
from vllm_pd_ext.proxy.metric_types import Counter, Gauge, Histogram
from vllm_pd_ext.proxy.metrics import ProxyMetrics
from vllm_pd_ext.proxy.sources import ROLES, KubernetesSource
from vllm_pd_ext.testing.fake_engine import ServerThread
from vllm_pd_ext.transport.mooncake import MooncakeConfig
from vllm_pd_ext.transport.tcp import TcpConfig

DEPLOY = deploy_files.DEPLOY
OVERLAYS = sorted(p.name for p in (DEPLOY / "overlays").iterdir() if p.is_dir())
COMPONENTS = sorted(p.name for p in (DEPLOY / "components").iterdir() if p.is_dir())


def _included(overlay: str) -> set[str]:
    """The components an overlay's kustomization includes itself."""
    doc = yaml.safe_load((DEPLOY / "overlays" / overlay / "kustomization.yaml").read_text())
    return {Path(c).name for c in doc.get("components", [])}


#: Every overlay alone, and the first overlay with each component it does not include.
RENDERS = [(o, None) for o in OVERLAYS] + [
    (OVERLAYS[0], c) for c in COMPONENTS if c not in _included(OVERLAYS[0])
]
#: The oldest and the newest minor release validated against.
K8S_VERSIONS = ("1.31.0", "1.35.0")
#: Transport backends the manifests use, with the model that validates their settings.
BACKEND_SETTINGS: dict[str, type[BaseModel]] = {"tcp": TcpConfig, "mooncake": MooncakeConfig}
#: Secrets the operator creates (docs/deploy.md); never in the repository.
SECRETS = {
    "vllm-pd-fleet-key": {"fleet.key"},
    "vllm-pd-api": {"api-key", "render-api-key", "metrics-token"},
}


def _kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        raise MissingDependency(("kubectl",), "rendering deploy/ with kubectl kustomize")
    return path


@functools.cache
def _render(overlay: str, component: str | None, workdir: str) -> tuple[dict, ...]:
    target = DEPLOY / "overlays" / overlay
    if component is not None:  # a kustomization of the overlay plus the component
        root = Path(workdir) / f"{overlay}+{component}"
        root.mkdir(parents=True, exist_ok=True)
        rel = os.path.relpath(DEPLOY, root)
        (root / "kustomization.yaml").write_text(
            yaml.safe_dump(
                {
                    "resources": [f"{rel}/overlays/{overlay}"],
                    "components": [f"{rel}/components/{component}"],
                }
            )
        )
        target = root
    out = subprocess.run(
        [_kubectl(), "kustomize", str(target)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


@pytest.fixture(scope="module")
def render(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("kustomize"))
    return lambda overlay, component=None: _render(overlay, component, workdir)


def _named(docs, kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _pod(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]


def _engines(docs) -> dict[str, dict]:
    return {
        n: d
        for n, d in _named(docs, "Deployment").items()
        if d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component")
        == "engine"
    }


def _proxy_config(docs) -> ProxyConfig:
    [cm] = [d for d in docs if d["kind"] == "ConfigMap" and "proxy.yaml" in d.get("data", {})]
    return ProxyConfig.model_validate(yaml.safe_load(cm["data"]["proxy.yaml"]))


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def _configmap_value(docs, ref: dict) -> str:
    return _named(docs, "ConfigMap")[ref["name"]]["data"][ref["key"]]


def test_overlays_are_the_documented_ones():
    assert OVERLAYS == ["cpu-smoke", "gpu-xpyd"]
    assert COMPONENTS == ["kv-events"]


# -- schemas -------------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize(("overlay", "component"), RENDERS, ids=lambda v: v or "alone")
def test_every_rendered_manifest_validates(render, overlay, component, version):
    need("kubernetes_validate", why="validating manifests against the Kubernetes schemas")
    import kubernetes_validate

    docs = render(overlay, component)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "PodDisruptionBudget", "Role", "NetworkPolicy"} <= kinds
    for doc in docs:
        # strict: a field the schema does not know (a typo, a misplaced key) fails too
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_validator_refuses_a_broken_manifest(render):
    need("kubernetes_validate", why="validating manifests against the Kubernetes schemas")
    import kubernetes_validate

    deployment = copy.deepcopy(next(iter(_engines(render(OVERLAYS[0])).values())))
    _pod(deployment)["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/health"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[0], strict=True)


# -- the manifests agree with our parts ------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_proxy_finds_the_engines_the_manifests_run(render, overlay):
    docs = render(overlay)
    cfg = _proxy_config(docs)
    k8s = cfg.kubernetes
    assert k8s is not None and cfg.protocol == "pdext-read"  # needs no per-instance addresses
    namespaces = {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"}
    assert namespaces == {k8s.namespace}
    selector = dict(pair.split("=", 1) for pair in k8s.label_selector.split(","))
    roles = set()
    for name, deployment in _engines(docs).items():
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), name
        roles.add(labels[k8s.role_label])
        [container] = _pod(deployment)["containers"]
        http = {p["name"]: p["containerPort"] for p in container["ports"]}["http"]
        assert http == k8s.port and f"--port={http}" in container["args"], name
    assert roles == {"prefill", "decode"} and roles <= set(ROLES)
    # nothing else carries the selector's labels (the proxy would send it requests)
    others = [
        n
        for n, d in _named(docs, "Deployment").items()
        if n not in _engines(docs)
        and selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
    ]
    assert others == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_render_urls_reach_the_render_servers(render, overlay):
    docs = render(overlay)
    services = _named(docs, "Service")
    render_pods = [
        d
        for d in _named(docs, "Deployment").values()
        if d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component")
        == "render"
    ]
    assert render_pods
    for url in _proxy_config(docs).render:
        parts = urlsplit(url)
        service = services[str(parts.hostname)]
        assert parts.port in [p["port"] for p in service["spec"]["ports"]]
        for deployment in render_pods:
            labels = deployment["spec"]["template"]["metadata"]["labels"]
            assert service["spec"]["selector"].items() <= labels.items()
            [container] = _pod(deployment)["containers"]
            assert f"--port={parts.port}" in container["args"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_engine_runs_our_connector_for_its_role_with_the_fleet_key(render, overlay):
    docs = render(overlay)
    kv_role = {"prefill": "kv_producer", "decode": "kv_consumer"}
    for name, deployment in _engines(docs).items():
        role = deployment["spec"]["template"]["metadata"]["labels"]["vllm-pd.io/role"]
        pod = _pod(deployment)
        [container] = pod["containers"]
        env = _env(container)
        assert "--kv-transfer-config=$(KV_TRANSFER_CONFIG)" in container["args"], name
        kv = json.loads(
            _configmap_value(docs, env["KV_TRANSFER_CONFIG"]["valueFrom"]["configMapKeyRef"])
        )
        assert kv["kv_connector"] == "PdExtMoRIIOConnector" and kv["kv_role"] == kv_role[role]
        transfer = parse_transfer_config(kv["kv_connector"], kv["kv_connector_extra_config"])
        BACKEND_SETTINGS[transfer.backend].model_validate(transfer.backend_settings)
        # the side channel and data server bind and advertise the pod IP
        assert transfer.side_channel_host is None and "host" not in transfer.backend_settings
        assert env["VLLM_HOST_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["kv-side"] == transfer.side_channel_port, name
        if transfer.backend == "tcp":
            assert ports["kv-data"] == transfer.backend_settings["port"], name
        # the key file: a copy the init container makes from the Secret, mode 0400
        key_file = Path(env[fleet_key.KEY_FILE_ENV]["value"])
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volume = mounts[str(key_file.parent)]
        [init] = [c for c in pod["initContainers"] if c["name"] == "fleet-key"]
        assert init["command"][:3] == ["install", "-m", "0400"]
        assert init["command"][-1] == str(key_file)
        source = Path(init["command"][-2])
        init_mounts = {m["mountPath"]: m["name"] for m in init["volumeMounts"]}
        assert init_mounts[str(key_file.parent)] == volume
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes[volume]["emptyDir"]["medium"] == "Memory"
        secret = volumes[init_mounts[str(source.parent)]]["secret"]
        assert secret["secretName"] == "vllm-pd-fleet-key"
        assert [i["path"] for i in secret["items"]] == [source.name]
        assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_secrets_are_referenced_not_shipped(render, overlay):
    docs = render(overlay)
    assert not [d for d in docs if d["kind"] == "Secret"]
    text = json.dumps(docs)
    for name in SECRETS:
        assert f'"{name}"' in text
    used: dict[str, set[str]] = {}
    for deployment in _named(docs, "Deployment").values():
        for container in _pod(deployment)["containers"]:
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    used.setdefault(ref["name"], set()).add(ref["key"])
        for volume in _pod(deployment).get("volumes", []):
            if "secret" in volume:
                items = {i["key"] for i in volume["secret"]["items"]}
                used.setdefault(volume["secret"]["secretName"], set()).update(items)
    assert used == SECRETS


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_are_locked_down(render, overlay):
    docs = render(overlay)
    proxy_accounts = set()
    for name, deployment in _named(docs, "Deployment").items():
        pod = _pod(deployment)
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", name
        for c in pod["containers"] + pod.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, (name, c["name"])
            assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"]
            assert sc["readOnlyRootFilesystem"] is True, (name, c["name"])
            assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
        if pod.get("automountServiceAccountToken", True):
            proxy_accounts.add(pod["serviceAccountName"])
    assert proxy_accounts == {"vllm-pd-proxy"}  # the only pod with an API token
    policies = _named(docs, "NetworkPolicy")
    assert policies["vllm-pd-default-deny"]["spec"] == {
        "podSelector": {},
        "policyTypes": ["Ingress"],
    }


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_use_the_real_health_routes(render, overlay):
    docs = render(overlay)
    for name, deployment in _named(docs, "Deployment").items():
        [container] = _pod(deployment)["containers"]
        probe = container["readinessProbe"]["httpGet"]
        assert (probe["path"], probe["port"]) == ("/health", "http"), name
        assert "livenessProbe" in container, name
    for name in ("vllm-pd-prefill", "vllm-pd-decode", "vllm-pd-render", "vllm-pd-proxy"):
        budget = _named(docs, "PodDisruptionBudget")[name]
        labels = _named(docs, "Deployment")[name]["spec"]["template"]["metadata"]["labels"]
        assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()


# -- RBAC against the real fleet source ------------------------------------------------------


class RecordingApiServer:
    """Answers the pod list the fleet source asks for (label selectors: ``k=v,...``) and
    records every request as Kubernetes authorizes it: (verb, API group, resource,
    namespace)."""

    def __init__(self, pods: list[dict], token: str) -> None:
        self.pods, self.token = pods, token
        self.requests: list[tuple[str, str, str, str]] = []

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
        async def any_call(path: str, request: Request) -> JSONResponse:
            assert request.headers.get("authorization") == f"Bearer {self.token}"
            attrs = _authorization_attributes(request.method, "/" + path, request.url.query)
            self.requests.append(attrs)
            verb, group, resource, _ = attrs
            if (verb, group, resource) != ("list", "", "pods"):
                return JSONResponse({"kind": "Status", "code": 404}, status_code=404)
            selector = request.query_params.get("labelSelector", "")
            wanted = dict(pair.split("=", 1) for pair in selector.split(",") if pair)
            items = [p for p in self.pods if wanted.items() <= p["metadata"]["labels"].items()]
            return JSONResponse({"kind": "PodList", "items": items})

        return app


def _authorization_attributes(method: str, path: str, query: str) -> tuple[str, str, str, str]:
    """(verb, apiGroup, resource, namespace) of a resource request, as the API server's
    request-info resolver derives them."""
    parts = [p for p in path.split("/") if p]
    if parts[:1] == ["api"]:
        group, rest = "", parts[2:]
    else:
        assert parts[:1] == ["apis"], path
        group, rest = parts[1], parts[3:]
    namespace = ""
    if rest[:1] == ["namespaces"] and len(rest) > 2:
        namespace, rest = rest[1], rest[2:]
    resource, named = rest[0], len(rest) > 1
    watch = parse_qs(query).get("watch", ["false"])[0] in ("true", "1")
    verb = {
        "GET": ("get" if named else "watch" if watch else "list"),
        "POST": "create",
        "PUT": "update",
        "PATCH": "patch",
        "DELETE": ("delete" if named else "deletecollection"),
    }[method]
    return verb, group, resource, namespace


def _running(deployment: dict, index: int) -> dict:
    template = deployment["spec"]["template"]
    return {
        "metadata": {
            "name": f"{deployment['metadata']['name']}-{index}",
            "labels": template["metadata"]["labels"],
        },
        "status": {
            "phase": "Running",
            "podIP": f"10.0.0.{index + 1}",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def _grants(docs, account: str, namespace: str) -> set[tuple[str, str, str]]:
    """(verb, apiGroup, resource) the service account may use in ``namespace``."""
    roles = _named(docs, "Role")
    grants = set()
    for binding in _named(docs, "RoleBinding").values():
        subjects = binding["subjects"]
        if not any(s["kind"] == "ServiceAccount" and s["name"] == account for s in subjects):
            continue
        assert binding["metadata"]["namespace"] == namespace
        assert binding["roleRef"]["kind"] == "Role"
        for rule in roles[binding["roleRef"]["name"]]["rules"]:
            assert "resourceNames" not in rule and "nonResourceURLs" not in rule
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        grants.add((verb, group, resource))
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    return grants


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_proxy_rbac_grants_exactly_what_its_kubernetes_source_calls(render, overlay, tmp_path):
    docs = render(overlay)
    cfg = _proxy_config(docs)
    assert cfg.kubernetes is not None
    engines = list(_engines(docs).values())
    pods = [_running(d, i) for i, d in enumerate(engines)]
    (tmp_path / "token").write_text("sa-token\n")
    api = RecordingApiServer(pods, token="sa-token")
    with ServerThread(api.app()) as server:
        source_cfg = cfg.kubernetes.model_copy(
            update={
                "api_server": f"http://127.0.0.1:{server.port}",
                "token_file": tmp_path / "token",
                "ca_file": None,
            }
        )

        async def fetch() -> Any:
            source = KubernetesSource(source_cfg)
            try:
                return await source.fetch()
            finally:
                await source.close()

        found = asyncio.run(fetch())
    assert found is not None
    assert sorted(i.role for i in found) == sorted(
        d["spec"]["template"]["metadata"]["labels"]["vllm-pd.io/role"] for d in engines
    )
    assert api.requests, "the source made no API call"
    namespace = cfg.kubernetes.namespace
    [proxy] = [
        d
        for d in _named(docs, "Deployment").values()
        if _pod(d)["containers"][0]["command"][:2] == ["vllm-pd", "proxy"]
    ]
    grants = _grants(docs, _pod(proxy)["serviceAccountName"], namespace)
    calls = set()
    for verb, group, resource, ns in api.requests:
        assert ns == namespace, (verb, resource, ns)
        calls.add((verb, group, resource))
    assert calls <= grants, f"calls the Role does not allow: {calls - grants}"
    assert grants <= calls, f"grants the source never uses: {grants - calls}"


# -- dashboard and alert rules ---------------------------------------------------------------


def test_dashboard_is_well_formed():
    dash = deploy_files.dashboard()
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert variables == {"datasource", "namespace"}
    for panel in dash["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert 'namespace="$namespace"' in target["expr"], panel["title"]
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
    titles = " ".join(p["title"] for p in dash["panels"]).lower()
    for topic in ("ttft", "itl", "split ratio", "fallbacks", "breaker", "transfer", "queued"):
        assert topic in titles, topic
    for topic in ("render latency", "kv cache usage", "lease expiries", "by pair"):
        assert topic in titles, topic


def test_alert_rules_are_well_formed():
    rules = deploy_files.rules()
    assert (rules["apiVersion"], rules["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    names = []
    for group in rules["spec"]["groups"]:
        assert set(group) == {"name", "rules"}
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
            assert rule["labels"]["severity"] in ("warning", "critical")
            assert rule["annotations"]["summary"]
            assert rule["expr"].count("(") == rule["expr"].count(")"), rule["expr"]
            names.append(rule["alert"])
    assert len(names) == len(set(names))
    for topic in ("Stall", "Fallback", "LeaseExpiries", "NoHealthyDecode", "Unhealthy", "Pair"):
        assert any(topic in n for n in names), topic


def test_metric_names_reads_what_promql_selects():
    expr = (
        "histogram_quantile(0.95, sum by (le, decision) (rate(vllm_pd_ttft_seconds_bucket"
        '{namespace="$namespace", route=~"a|b"}[$__rate_interval])))'
        " / on (pod) group_left (x) vllm:kv_cache_usage_perc > 0 and sum(up offset 5m)"
        " > on (namespace) group_left 2 * vllm_pd_in_flight"
    )
    assert deploy_files.metric_names(expr) == {
        "vllm_pd_ttft_seconds_bucket",
        "vllm:kv_cache_usage_perc",
        "up",
        "vllm_pd_in_flight",
    }


def test_dashboard_and_rules_name_metrics_of_our_parts_and_vllm():
    names = deploy_files.all_metric_names()
    assert len(names) >= 20
    assert all(n.startswith(("vllm_pd_", "vllm:")) for n in names), names


#: Labels Prometheus adds to every series it scrapes (podmonitors.yaml), and histograms' ``le``.
SCRAPE_LABELS = {"namespace", "pod", "le"}


def test_the_proxy_metrics_the_files_use_are_the_proxys_with_the_labels_they_group_by():
    """Without a running stack: every ``vllm_pd_`` name (but the render server's) is a
    sample the proxy's registry exposes, and each ``by (...)`` of an expression that selects
    one proxy metric names only that metric's labels (pairs: ``prefill``, ``decode``)."""
    exposed: dict[str, set[str]] = {}
    for metric in vars(ProxyMetrics()).values():
        if isinstance(metric, Counter | Gauge | Histogram):
            suffixes = {Counter: ("_total",), Histogram: ("_bucket", "_sum", "_count")}
            for suffix in suffixes.get(type(metric), ("",)):
                exposed[metric.name + suffix] = set(metric.labelnames)
    used = {n for n in deploy_files.all_metric_names() if n.startswith("vllm_pd_")}
    proxy = {n for n in used if not n.startswith("vllm_pd_render_")}
    assert proxy - set(exposed) == set()
    assert {"vllm_pd_transfer_gap_seconds_bucket", "vllm_pd_split_failures_total"} <= proxy
    for expr in deploy_files.dashboard_expressions() + deploy_files.rule_expressions():
        names = deploy_files.metric_names(expr) & proxy
        if len(names) != 1:
            continue
        (name,) = names
        for group in re.finditer(r"\bby\s*\(([^)]*)\)", expr):
            grouped = {g.strip() for g in group.group(1).split(",") if g.strip()}
            assert grouped - SCRAPE_LABELS <= exposed[name], (name, expr)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kv_events_are_vllms_followed_by_the_proxy_and_reachable_by_it_only(render, overlay):
    """Every overlay's engines publish KV events with vLLM's own flag, their pods' annotations
    lead the proxy's Kubernetes source to those very ports and topic, and the proxy routes
    on them (cache-aware)."""
    need("vllm", why="vLLM's KVEventsConfig")
    from vllm.config.kv_events import KVEventsConfig

    assert "kv-events" in _included(overlay)
    docs = render(overlay)
    proxy_config = _proxy_config(docs)
    assert proxy_config.decode_policy == proxy_config.prefill_policy == "cache-aware"
    assert proxy_config.kubernetes is not None
    source = KubernetesSource(proxy_config.kubernetes.model_copy(update={"api_server": "http://k"}))
    flag = "--kv-events-config="
    for name, deployment in _engines(docs).items():
        [container] = _pod(deployment)["containers"]
        [arg] = [a for a in container["args"] if a.startswith(flag)]
        config = KVEventsConfig(**json.loads(arg.removeprefix(flag)))
        assert config.enable_kv_cache_events and config.publisher == "zmq"
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        for endpoint, port_name in (
            (config.endpoint, "kv-events"),
            (config.replay_endpoint, "kv-replay"),
        ):
            assert endpoint == f"tcp://*:{ports[port_name]}", name
        running = {
            "metadata": {**deployment["spec"]["template"]["metadata"], "name": f"{name}-0"},
            "status": {
                "phase": "Running",
                "podIP": "10.0.0.7",
                "conditions": [{"type": "Ready", "status": "True"}],
            },
        }
        instance = source._instance(running)
        assert instance is not None and instance.kv_events is not None, name
        assert instance.kv_events.endpoint == f"tcp://10.0.0.7:{ports['kv-events']}"
        assert instance.kv_events.replay_endpoint == f"tcp://10.0.0.7:{ports['kv-replay']}"
        assert instance.kv_events.topic == config.topic
    rules = _named(docs, "NetworkPolicy")["vllm-pd-engines"]["spec"]["ingress"]
    [events] = [r for r in rules if {"port": "kv-events"} in r.get("ports", [])]
    assert events["ports"] == [{"port": "kv-events"}, {"port": "kv-replay"}]
    [source] = events["from"]
    assert source["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "proxy"
