"""The vllm.general_plugins entry point: idempotent, cheap, registers our three names."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.conftest import requires_vllm
from tests.skips import not_applicable
from vllm_pd_ext import plugin

REPO = Path(__file__).resolve().parents[2]


def test_entry_point_is_declared():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    ours = [ep for ep in eps if ep.value == "vllm_pd_ext.plugin:register"]
    assert len(ours) == 1
    assert ours[0].load() is plugin.register


def test_module_import_is_cheap():
    code = (
        "import sys, vllm_pd_ext.plugin\n"
        "heavy = [m for m in ('torch', 'vllm') if m in sys.modules]\n"
        "print(','.join(heavy))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == ""


@pytest.mark.parametrize(
    ("version", "supported"),
    [
        ("0.32.0", True),
        ("0.32.0+cpu", True),
        ("0.33.1", True),
        ("0.31.9", False),
        ("0.34.0", False),
        ("not-a-version", False),
    ],
)
def test_supported_range(version, supported):
    assert plugin.is_supported_vllm(version) is supported


def test_supported_range_is_the_vllm_extra_in_pyproject():
    if sys.version_info < (3, 11):
        not_applicable("tomllib (reading pyproject.toml) is Python 3.11+")
    else:
        import tomllib

        project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
        (requirement,) = project["optional-dependencies"]["vllm"]
        # read from the installed metadata: equal unless the install predates pyproject.toml
        assert plugin.supported_vllm() == Requirement(requirement).specifier


def test_unknown_range_warns(monkeypatch, caplog):
    monkeypatch.setattr(plugin, "installed_vllm_version", lambda: "0.32.0")
    monkeypatch.setattr(plugin, "supported_vllm", lambda: None)
    with caplog.at_level(logging.WARNING, logger="vllm_pd_ext.plugin"):
        assert plugin.check_vllm_version() is False
    assert "cannot read the supported vLLM range" in caplog.text


def test_untested_version_warns_and_does_not_raise(monkeypatch, caplog):
    monkeypatch.setattr(plugin, "installed_vllm_version", lambda: "0.30.1")
    with caplog.at_level(logging.WARNING, logger="vllm_pd_ext.plugin"):
        assert plugin.check_vllm_version() is False
    assert "0.30.1 is outside the tested range" in caplog.text


def test_missing_vllm_warns(monkeypatch, caplog):
    monkeypatch.setattr(plugin, "installed_vllm_version", lambda: None)
    with caplog.at_level(logging.WARNING, logger="vllm_pd_ext.plugin"):
        assert plugin.check_vllm_version() is False
    assert "not installed" in caplog.text


@requires_vllm
def test_register_twice_resolves_our_classes():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    plugin.register()
    plugin.register()
    for name, (module, cls_name) in plugin.CONNECTORS.items():
        cls = KVConnectorFactory.get_connector_class_by_name(name)
        assert (cls.__module__, cls.__name__) == (module, cls_name)


@requires_vllm
def test_register_tolerates_names_registered_by_another_copy(monkeypatch):
    """A fresh process where someone registered our names first: no exception."""
    code = (
        "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory\n"
        "from vllm_pd_ext import plugin\n"
        "for name, (m, c) in plugin.CONNECTORS.items():\n"
        "    KVConnectorFactory.register_connector(name, m, c)\n"
        "plugin.register(); plugin.register(); print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("ok")


@requires_vllm
def test_connector_classes_and_hybrid_support():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1 import supports_hma

    plugin.register()
    classes = {
        name: KVConnectorFactory.get_connector_class_by_name(name) for name in plugin.CONNECTORS
    }
    assert {name: cls.__name__ for name, cls in classes.items()} == {
        n: n for n in plugin.CONNECTORS
    }
    assert supports_hma(classes["PdExtMambaStateConnector"])
    assert not supports_hma(classes["PdExtMoRIIOConnector"])  # vLLM turns HMA off for it


@requires_vllm
def test_self_check_report(tmp_path):
    report = tmp_path / "self-check.jsonl"
    code = "from vllm_pd_ext import plugin; plugin.register(); plugin.register()"
    env = {**__import__("os").environ, plugin.SELF_CHECK_ENV: str(report)}
    subprocess.run([sys.executable, "-c", code], env=env, timeout=120, check=True)
    lines = report.read_text().splitlines()
    assert len(lines) == 1  # idempotent: the second register() writes nothing
    record = json.loads(lines[0])
    assert record["resolved"] == {
        name: f"{module}.{cls}" for name, (module, cls) in plugin.CONNECTORS.items()
    }
