"""The files under deploy/ that tests read, and the metric names their PromQL expressions use
(tests/unit/test_deploy.py checks their form, tests/integration/test_deploy_metrics.py the
names against a real stack's /metrics)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

DEPLOY = Path(__file__).parent.parent / "deploy"
DASHBOARD = DEPLOY / "grafana" / "vllm-pd.json"
RULES = DEPLOY / "prometheus" / "vllm-pd-rules.yaml"

#: Words of PromQL that look like metric names (``group_left`` / ``group_right`` may stand
#: without a label list).
_KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "group_left", "group_right"})
#: Modifiers followed by a parenthesised list of label names.
_LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def rules() -> dict:
    return yaml.safe_load(RULES.read_text())


def dashboard_expressions() -> list[str]:
    """Every PromQL expression of the Grafana dashboard's panels."""
    return [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]


def dashboard_variable_metrics() -> set[str]:
    """The metrics the dashboard's query variables read (``label_values(METRIC, label)``)."""
    names = set()
    for var in dashboard()["templating"]["list"]:
        if var["type"] == "query":
            found = re.fullmatch(
                r"label_values\(([A-Za-z_:][A-Za-z0-9_:]*),\s*\w+\)", var["definition"]
            )
            assert found, var["definition"]
            names.add(found.group(1))
    return names


def rule_expressions() -> list[str]:
    """Every PromQL expression of the alert rules."""
    return [r["expr"] for g in rules()["spec"]["groups"] for r in g["rules"]]


def metric_names(expr: str) -> set[str]:
    """The metric (sample) names a PromQL expression selects."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range and subquery windows
    text = _LABEL_LISTS.sub("", text)
    text = re.sub(r"\b\d+(?:\.\d+)?(?:[eE][+-]?\d+)?(?:ms|[smhdwy])?\b", "", text)  # numbers
    names = set()
    for found in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        if text[found.end() :].lstrip().startswith("("):  # a function or aggregation
            continue
        if found.group(0) not in _KEYWORDS:
            names.add(found.group(0))
    return names


def all_metric_names() -> set[str]:
    """Every metric name the dashboard and the alert rules use."""
    names = dashboard_variable_metrics()
    for expr in dashboard_expressions() + rule_expressions():
        names |= metric_names(expr)
    return names
