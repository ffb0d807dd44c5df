"""The two kinds of skip this suite allows, and what CI does with each (a pytest plugin).

A test that skips says why, through this module:

* **a missing dependency**: the real part the test exercises (vLLM, Mooncake's transfer engine,
  NIXL, torch, schemathesis, ...) is not installed. ``requires(...)`` is the mark, ``need(...)``
  the call (in a test, a fixture, or at module level). Outside CI this skips; under CI it fails,
  naming the dependency, so a run without the real parts cannot pass.
* **not applicable**: the case does not exist here (a contract case a backend does not have, a
  check that only means something while an optional package is absent). ``not_applicable(...)``
  skips everywhere, CI included.

Under CI (the ``CI`` environment variable set to a true value, as CI services and ``.ci/run`` do)
every other skip fails too: a bare ``pytest.skip``, ``pytest.importorskip`` or ``skipif`` mark,
a module or directory skipped at collection. A new skip site therefore cannot slip through CI by
forgetting to say which kind it is.

tests/conftest.py loads this module as a plugin (``pytest_plugins``) after importing it, so it
is not assertion-rewritten (it asserts nothing): PYTEST_DONT_REWRITE.
"""

from __future__ import annotations

import importlib.util
import os
from typing import NoReturn

import pytest

#: Values of ``CI`` that turn the rule on (CI services set ``CI=true``).
_TRUE = frozenset({"1", "true", "yes", "on"})


def under_ci() -> bool:
    """Whether this run is CI: ``CI`` is set to a true value."""
    return os.environ.get("CI", "").strip().lower() in _TRUE


# pytest.skip.Exception is pytest's public name for its skip exception; mypy sees no class in it
class MissingDependency(pytest.skip.Exception):  # type: ignore[name-defined]
    """Skip: ``modules`` are not installed. Fails under CI."""

    __module__ = "builtins"  # as pytest's own Skipped: reports read "MissingDependency: ..."

    def __init__(self, modules: tuple[str, ...], why: str, **skip_options: bool):
        self.modules, self.why = modules, why
        super().__init__(f"{', '.join(modules)} ({why})", **skip_options)


class NotApplicable(pytest.skip.Exception):  # type: ignore[name-defined]
    """Skip: the case does not apply here. Skips under CI too."""

    __module__ = "builtins"


def missing(*modules: str) -> list[str]:
    """The top-level modules among ``modules`` that cannot be found (nothing is imported)."""
    return [m for m in modules if importlib.util.find_spec(m) is None]


def need(*modules: str, why: str, allow_module_level: bool = False) -> None:
    """Skip the current test (or module) unless every one of ``modules`` is installed.

    ``why`` says what the test needs them for; the skip reason (and the CI failure) reads
    ``MissingDependency: <modules> (<why>)``."""
    __tracebackhide__ = True  # reports point at the caller
    absent = missing(*modules)
    if absent:
        raise MissingDependency(tuple(absent), why, allow_module_level=allow_module_level)


def requires(*modules: str, why: str) -> pytest.MarkDecorator:
    """Mark: the test needs ``modules`` (checked at set-up, before its fixtures, by ``need``)."""
    return pytest.mark.requires(*modules, why=why)


def not_applicable(reason: str) -> NoReturn:
    """Skip the current test: its case does not apply here. Not a missing dependency."""
    __tracebackhide__ = True
    raise NotApplicable(reason)


class _CollectionSkipFailure(pytest.Item):
    """Under CI, stands for the tests of a module or directory skipped at collection: fails."""

    def __init__(self, *, message: str, **kwargs):
        super().__init__(**kwargs)
        self.message = message

    def runtest(self) -> None:
        _fail(self.message)

    def reportinfo(self):
        return self.path, None, self.name


def _fail(message: str) -> NoReturn:
    pytest.fail(message, pytrace=False)


def _ci_failure(excinfo: pytest.ExceptionInfo | None, reason: str) -> str | None:
    """What a skip becomes under CI: ``None`` (it stays a skip) or the failure message."""
    error = excinfo.value if excinfo is not None else None
    if isinstance(error, NotApplicable):
        return None
    if isinstance(error, MissingDependency):
        return (
            f"{', '.join(error.modules)} not installed ({error.why}): under CI a missing "
            "dependency fails instead of skipping"
        )
    return (
        f"a skip that does not say its kind ({reason}): under CI a skip must be a missing "
        "dependency (tests.skips.need or requires; it fails) or not applicable "
        "(tests.skips.not_applicable)"
    )


def _reason(longrepr) -> str:
    if isinstance(longrepr, tuple):  # (path, lineno, message) for skips
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "requires(*modules, why): the test needs these installed (tests/skips.py: skips, or "
        "fails under CI, when they are not)",
    )


@pytest.hookimpl(tryfirst=True)  # before fixtures, as pytest's own skipif
def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers("requires"):
        absent = missing(*mark.args)
        if absent:  # reported at the test, as a skipif mark is
            raise MissingDependency(tuple(absent), mark.kwargs["why"], _use_item_location=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if report.skipped and not hasattr(report, "wasxfail") and under_ci():
        message = _ci_failure(call.excinfo, _reason(report.longrepr))
        if message is not None:  # the same phase, failed with the message instead
            failed = pytest.CallInfo.from_call(lambda: _fail(message), when=call.when)
            return pytest.TestReport.from_item_and_call(item, failed)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    report = yield
    if report.skipped and under_ci():
        call = getattr(report, "call", None)  # pytest keeps the CallInfo on the report
        message = _ci_failure(call.excinfo if call else None, _reason(report.longrepr))
        if message is not None:
            failure = _CollectionSkipFailure.from_parent(
                collector, name="skipped_at_collection", message=message
            )
            return pytest.CollectReport(report.nodeid, "passed", None, [failure])
    return report
