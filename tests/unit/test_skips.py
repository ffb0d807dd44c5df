"""tests/skips.py: under CI a skip for a missing dependency, or one that does not say its kind,
fails naming its reason; a not-applicable skip stays a skip. Outside CI all of them skip.

Each test runs pytest in a subprocess on a small suite with every kind of skip, against a
module that is really not installed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.skips import under_ci

pytest_plugins = ("pytester",)

REPO = Path(__file__).resolve().parents[2]
ABSENT = "vllm_pd_ext_no_such_module"
SUITE = {
    "conftest.py": 'pytest_plugins = ("tests.skips",)\n',
    "test_kinds.py": f"""
import pytest
from tests.skips import need, not_applicable, requires

def test_need():
    need("{ABSENT}", why="the call")

@requires("{ABSENT}", why="the mark")
def test_requires():
    pass

def test_not_applicable():
    not_applicable("not this case")

def test_bare_skip():
    pytest.skip("no kind given")

def test_passes():
    pass
""",
    "test_module_need.py": f"""
from tests.skips import need

need("{ABSENT}", why="the module", allow_module_level=True)

def test_never_collected():
    pass
""",
    "test_module_importorskip.py": f"""
import pytest

pytest.importorskip("{ABSENT}")

def test_never_collected():
    pass
""",
}


def _run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, ci: str | None):
    pytester.makepyfile(**{name.removesuffix(".py"): text for name, text in SUITE.items()})
    path = [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(path))
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # installed plugins: slow, unneeded
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    return pytester.runpytest_subprocess("-ra", "-p", "no:cacheprovider")


def test_under_ci_missing_dependencies_and_bare_skips_fail(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, "true")
    # test_requires fails at set-up (an error), where a skipif mark would skip
    result.assert_outcomes(passed=1, failed=4, errors=1, skipped=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines_random(
        [
            f"FAILED test_kinds.py::test_need - Failed: {ABSENT} not installed (the call): *",
            f"ERROR test_kinds.py::test_requires - Failed: {ABSENT} not installed (the mark): *",
            "FAILED test_kinds.py::test_bare_skip - Failed: a skip that does not say its kind "
            "(no kind given): *",
            f"FAILED test_module_need.py::skipped_at_collection - Failed: {ABSENT} not installed "
            "(the module): *",
            "FAILED test_module_importorskip.py::skipped_at_collection - Failed: a skip that "
            f"does not say its kind (could not import '{ABSENT}'*",
            "SKIPPED [[]1[]] test_kinds.py:*: NotApplicable: not this case",
        ]
    )


def test_outside_ci_every_kind_skips_with_its_reason(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, None)
    result.assert_outcomes(passed=1, skipped=6)
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines_random(
        [
            f"SKIPPED [[]1[]] test_kinds.py:*: MissingDependency: {ABSENT} (the call)",
            f"SKIPPED [[]1[]] test_kinds.py:*: MissingDependency: {ABSENT} (the mark)",
            "SKIPPED [[]1[]] test_kinds.py:*: NotApplicable: not this case",
            "SKIPPED [[]1[]] test_kinds.py:*: no kind given",
            f"SKIPPED [[]1[]] test_module_need.py:*: MissingDependency: {ABSENT} (the module)",
            f"SKIPPED [[]1[]] test_module_importorskip.py:*: could not import '{ABSENT}'*",
        ]
    )


@pytest.mark.parametrize(
    ("value", "ci"),
    [("true", True), ("1", True), ("YES", True), ("on", True), ("false", False), ("0", False),
     ("", False), (None, False)],
)  # fmt: skip
def test_ci_is_on_for_true_values_of_the_variable(monkeypatch, value, ci):
    if value is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", value)
    assert under_ci() is ci
