"""The Kubernetes fleet source against a fake API server on loopback."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tests.unit.proxy.helpers import SHORT, proxy, wait_until
from vllm_pd_ext.proxy.config import KVEventsConfig
from vllm_pd_ext.testing.fake_engine import ServerThread


def pod(name, port, role=None, ready=True, phase="Running", deleting=False, labels=None):
    labels = {"app": "vllm", **(labels or {})}
    if role:
        labels["vllm-pd.io/role"] = role
    meta = {"name": name, "labels": labels, "annotations": {"vllm-pd.io/port": str(port)}}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-30T00:00:00Z"
    return {
        "metadata": meta,
        "status": {
            "phase": phase,
            "podIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


class FakeApiServer:
    def __init__(self, token: str):
        self.token = token
        self.pods: list[dict] = []
        self.selectors: list[str] = []
        self.fail = False
        self.calls = 0
        self.url = ""  # set once it serves
        self.token_file = ""

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/api/v1/namespaces/{ns}/pods")
        async def pods(ns: str, request: Request) -> JSONResponse:
            self.calls += 1
            if request.headers.get("authorization") != f"Bearer {self.token}":
                return JSONResponse({"kind": "Status", "code": 401}, status_code=401)
            if self.fail:
                return JSONResponse({"kind": "Status", "code": 500}, status_code=500)
            selector = request.query_params.get("labelSelector", "")
            self.selectors.append(f"{ns}:{selector}")
            key, _, value = selector.partition("=")
            items = [p for p in self.pods if p["metadata"]["labels"].get(key) == value]
            return JSONResponse({"kind": "PodList", "items": items})

        return app


@pytest.fixture
def api(tmp_path):
    fake = FakeApiServer(token="sa-token")
    (tmp_path / "token").write_text("sa-token\n")
    with ServerThread(fake.app()) as server:
        fake.url = f"http://127.0.0.1:{server.port}"
        fake.token_file = str(tmp_path / "token")
        yield fake


def k8s_config(api) -> dict:
    return {
        "api_server": api.url,
        "namespace": "serving",
        "label_selector": "app=vllm",
        "token_file": api.token_file,
        "ca_file": None,
        "poll_interval_s": 0.1,
    }


def test_ready_pods_become_instances_with_roles(engines, api):
    api.pods = [
        pod("p-0", engines["p1"].port, role="prefill"),
        pod("d-0", engines["d1"].port, role="decode"),
        pod("d-1", engines["d2"].port, role="decode", ready=False),
        pod("d-2", engines["d2"].port, role="decode", deleting=True),
        pod("x-0", engines["p2"].port, role="router"),  # unknown role: skipped
        pod("other", engines["p2"].port, labels={"app": "other"}),
    ]
    with proxy(engines, instances=[], kubernetes=k8s_config(api)) as (base, svc):
        got = {(i.config.name, i.role, i.url) for i in svc.fleet.instances()}
        assert got == {
            ("serving/p-0", "prefill", engines["p1"].url),
            ("serving/d-0", "decode", engines["d1"].url),
        }
        assert api.selectors[0] == "serving:app=vllm"
        resp = httpx.post(
            f"{base}/v1/completions", json={"model": "m", "prompt": SHORT}, timeout=60
        )
        assert resp.status_code == 200 and len(engines["d1"].requests) == 1

        # Scale: d-1 turns Ready, d-0 goes away.
        api.pods[2] = pod("d-1", engines["d2"].port, role="decode")
        del api.pods[1]
        wait_until(lambda: {i.url for i in svc.fleet.healthy("decode")} == {engines["d2"].url})

        # An API outage keeps the last fleet.
        api.fail = True
        calls = api.calls
        wait_until(lambda: api.calls >= calls + 3)
        assert {i.url for i in svc.fleet.instances()} == {engines["p1"].url, engines["d2"].url}


@pytest.mark.parametrize(
    ("annotation", "pod_ip"),
    [
        ("8000@evil.example:9999/x?", "127.0.0.1"),  # the port pasted into the URL
        ("0", "127.0.0.1"),
        ("65536", "127.0.0.1"),
        ("\uff18\uff10\uff10\uff10", "127.0.0.1"),  # digits, but not ASCII ones
        (None, "evil.example"),  # a podIP that is a host name
        (None, "127.0.0.1:9/x"),
    ],
)
def test_a_pod_whose_annotation_or_ip_is_not_an_address_is_refused(
    engines, api, annotation, pod_ip
):
    """A pod's annotations and status are written by whoever may edit the pod: a port
    annotation that is not a port number, or a podIP that is not an IP address, never
    becomes (part of) an upstream URL; the pod is skipped and the rest of the fleet kept."""
    bad = pod("d-bad", engines["d2"].port, role="decode")
    if annotation is not None:
        bad["metadata"]["annotations"]["vllm-pd.io/port"] = annotation
    bad["status"]["podIP"] = pod_ip
    api.pods = [pod("d-0", engines["d1"].port, role="decode"), bad]
    with proxy(engines, instances=[], kubernetes=k8s_config(api)) as (_, svc):
        wait_until(lambda: api.calls >= 2)
        assert [i.url for i in svc.fleet.instances()] == [engines["d1"].url]


KV_EVENTS = {
    "vllm-pd.io/kv-events-port": "5557",
    "vllm-pd.io/kv-events-replay-port": "5558",
    "vllm-pd.io/kv-events-topic": "kv-events",
}


def test_a_pod_annotated_with_its_kv_events_ports_is_followed(engines, api):
    """A pod that says where it publishes its KV events (the kv-events component's
    annotations) becomes an instance whose events the proxy subscribes to, at the pod's IP;
    a pod that says nothing is routed on the estimate."""
    with_events = pod("d-0", engines["d1"].port, role="decode")
    with_events["metadata"]["annotations"].update(KV_EVENTS)
    api.pods = [with_events, pod("d-1", engines["d2"].port, role="decode")]
    with proxy(engines, instances=[], kubernetes=k8s_config(api)) as (_, svc):
        wait_until(lambda: len(svc.fleet.instances()) == 2)
        by_name = {i.config.name: i for i in svc.fleet.instances()}
        followed, plain = by_name["serving/d-0"], by_name["serving/d-1"]
        assert followed.config.kv_events == KVEventsConfig(
            endpoint="tcp://127.0.0.1:5557",
            replay_endpoint="tcp://127.0.0.1:5558",
            topic="kv-events",
        )
        assert followed.events is not None  # subscribed
        assert plain.config.kv_events is None and plain.events is None


@pytest.mark.parametrize(
    ("annotation", "value"),
    [
        ("vllm-pd.io/kv-events-port", "5557@evil.example:1/x"),
        ("vllm-pd.io/kv-events-port", "0"),
        ("vllm-pd.io/kv-events-replay-port", "70000"),
        ("vllm-pd.io/kv-events-topic", "a topic with spaces"),
        ("vllm-pd.io/kv-events-topic", "x" * 257),
    ],
)
def test_a_pod_whose_kv_events_annotation_is_not_an_address_serves_without_them(
    engines, api, annotation, value, caplog
):
    """KV events annotations that are not a port or a topic never become (part of) a
    ZeroMQ endpoint: the pod still serves, routed on the estimate, and the log says why."""
    bad = pod("d-0", engines["d1"].port, role="decode")
    bad["metadata"]["annotations"].update({**KV_EVENTS, annotation: value})
    api.pods = [bad]
    with proxy(engines, instances=[], kubernetes=k8s_config(api)) as (_, svc):
        wait_until(lambda: len(svc.fleet.instances()) == 1)
        (inst,) = svc.fleet.instances()
        assert inst.config.kv_events is None and inst.events is None
    assert "its KV events are not followed" in caplog.text
