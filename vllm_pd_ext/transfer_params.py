"""The ``kv_transfer_params`` contract: every shape we produce or accept, typed and versioned.

vLLM hands a request's ``kv_transfer_params`` (and ``ec_transfer_params``, the encoder cache's)
to the KV connectors: where to load a prompt's KV from, where to push it, which blocks. The
fields reach the engine at the top level of a request or inside ``vllm_xargs`` (vLLM copies
those into ``sampling_params.extra_args``, where the connectors read them), so a client who can
set either can point an engine at any host. Only the proxy sets them; every part that takes a
client's request removes them (the proxy) or refuses them (the render server, in
``vllm_xargs``).

Each shape is a frozen dataclass whose field names are the wire keys: ``params()`` builds the
dict a request carries, ``parse()`` (for the shapes a connector of ours or a test fake reads)
checks one and raises :class:`InvalidParams`. No other code spells these keys.

* :class:`NixlPrefill`: the prefill leg of vLLM's NixlConnector (pull and push);
  :class:`NixlAnswer`: the part of its prefill's answer a decode side reads;
  :class:`PrefillCacheHits`: the prefix-cache hits a prefill's answer may report.
* :class:`MooncakePrefill` / :class:`MooncakeDecode`: vLLM's MooncakeConnector, both legs.
* :class:`PrefillLeg`: the prefill leg of MoRI-IO read (``transfer_id``) and of ours
  (``transfer_mode``, and ``transfer_id`` for WRITE); :class:`MoRIIOReadAnswer`: what vLLM's
  MoRIIOConnector answers; :class:`MoRIIOWritePrefill` / :class:`MoRIIOWriteDecode`: its WRITE
  legs, each naming its peer.
* :class:`PdExtReadAnswer`: our prefill engine's READ answer (where the prompt's KV waits; one
  list of block ids per KV cache group on hybrid models); :class:`PdExtWriteDecode`: the decode
  leg of our WRITE, built by the proxy. Both are signed under the fleet key when one is set
  (:mod:`vllm_pd_ext.fleet_key`) and carry :data:`VERSION`; :class:`ReadSource`: the part of a
  READ answer that names where its blocks are held.

Version history of our own shapes (their ``pdext_version``):

1. The READ answer (vLLM's NIXL fields plus ``transfer_mode``, ``prompt_hash``, ``lease_s``,
   ``protocol``) and the WRITE decode params.
2. ``signature``: HMAC-SHA256 under the fleet key over every field but the flags.
3. ``pdext_version`` and ``expires_at`` (wall-clock seconds, signed): a keyed decode engine
   refuses params that arrive after it (``fleet_key.MAX_SKEW_S`` of clock skew allowed), and
   refuses a version it does not speak (a fleet upgrades its engines together).

Imports nothing of ours but ``fleet_key`` (which imports nothing of ours): every part may use it.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from vllm_pd_ext import fleet_key

#: The fields vLLM's connectors act on, top level or in ``vllm_xargs``/``extra_args``.
STEERING_FIELDS = ("kv_transfer_params", "ec_transfer_params")

#: The version of our own shapes (see the history above).
VERSION = 3
#: Name our shapes carry so a decode instance can tell our protocol from another's.
PROTOCOL = "pdext"
#: Our transfer modes: the decode side pulls (READ) or the prefill side pushes (WRITE).
READ, WRITE = "read", "write"
#: How long the proxy's signed WRITE params stay valid after it builds them (seconds).
WRITE_TTL_S = 60.0
#: The flags vLLM's P/D connectors read: this leg loads its KV from a remote (decode), or
#: keeps it for a remote (prefill). Connectors flip ``DO_REMOTE_PREFILL`` off in place once
#: they have acted on it, so no signature covers the flags.
DO_REMOTE_PREFILL = "do_remote_prefill"
DO_REMOTE_DECODE = "do_remote_decode"
#: Block ids in an answer at most (one group or all groups together).
MAX_BLOCK_IDS = 1 << 20


class InvalidParams(ValueError):
    """Params that do not fit their shape, their signature, their version or their time."""


def without_steering(fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` (``vllm_xargs``, ``extra_args``) without the ``STEERING_FIELDS``."""
    return {k: v for k, v in fields.items() if k not in STEERING_FIELDS}


# ---- the flags and fields connectors read from any leg ----
def loads_remote(params: Mapping[str, Any] | None) -> bool:
    """Whether a leg asks its engine to load the prompt's KV from a remote (decode)."""
    return bool(params and params.get(DO_REMOTE_PREFILL))


def keeps_for_remote(params: Mapping[str, Any] | None) -> bool:
    """Whether a leg asks its engine to keep the prompt's KV for a remote (prefill)."""
    return bool(params and params.get(DO_REMOTE_DECODE))


def mark_loaded(params: dict[str, Any]) -> None:
    """Record in place that the load was acted on (or refused): one transfer per request."""
    params[DO_REMOTE_PREFILL] = False


def mode_of(params: Mapping[str, Any], default: str) -> str:
    """A leg's ``transfer_mode``, or ``default`` when it names none."""
    return str(params.get(_TRANSFER_MODE) or default)


def transfer_id_of(params: Mapping[str, Any]) -> str | None:
    """A leg's ``transfer_id`` (WRITE, Mooncake, MoRI-IO), or None."""
    tid = params.get(_TRANSFER_ID)
    return tid if isinstance(tid, str) and tid else None


# ---- field checks, by the annotation a field is declared with ----
def _is_str(v: Any) -> bool:
    return isinstance(v, str) and bool(v)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_port(v: Any) -> bool:
    return _is_int(v) and 0 < v < 65536


def _is_number(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and v == v  # not NaN


def _is_ids(v: Any) -> bool:
    return isinstance(v, list) and len(v) <= MAX_BLOCK_IDS and all(_is_int(b) for b in v)


def _is_block_ids(v: Any) -> bool:
    if not isinstance(v, list) or not v or not isinstance(v[0], list):
        return _is_ids(v)
    return (
        len(v) <= MAX_BLOCK_IDS
        and sum(len(g) for g in v if isinstance(g, list)) <= MAX_BLOCK_IDS
        and all(_is_ids(g) for g in v)
    )


#: A field's check, by its annotation (the annotations below are strings).
_CHECKS: dict[str, Callable[[Any], bool]] = {
    "str": _is_str,
    "str | None": lambda v: v is None or _is_str(v),
    "int": _is_int,
    "int | None": lambda v: v is None or _is_int(v),
    "Port": _is_port,
    "float": _is_number,
    "BlockIds": _is_block_ids,
    "None": lambda v: v is None,
}
#: Annotations that only name a check.
Port = int
BlockIds = list[int] | list[list[int]]


class _Shape:
    """Field names are wire keys; ``FLAGS`` are constant keys every instance carries."""

    FLAGS: ClassVar[dict[str, Any]] = {}
    #: Fields left out of ``params()`` while None.
    DROP_NONE: ClassVar[bool] = False

    @classmethod
    @functools.cache  # one entry per shape class: the proxy signs on every request
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]

    @classmethod
    @functools.cache
    def _layout(cls) -> tuple[tuple[str, Any, Callable[[Any], bool]], ...]:
        """Each field's name, default (``dataclasses.MISSING`` when required) and check."""
        return tuple(
            (f.name, f.default, _CHECKS[str(f.type)])
            for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        )

    def params(self) -> dict[str, Any]:
        out = dict(self.FLAGS)
        for name in self.names():
            value = getattr(self, name)
            if value is not None or not self.DROP_NONE:
                out[name] = list(value) if isinstance(value, list) else value
        return out

    @classmethod
    def parse(cls: type[_S], params: Mapping[str, Any]) -> _S:
        """The shape ``params`` hold; InvalidParams naming the first field that is wrong. The
        flags a connector flips in place once it has acted on them are not checked (ask
        :func:`loads_remote` / :func:`keeps_for_remote`)."""
        if not isinstance(params, Mapping):
            raise InvalidParams("kv_transfer_params is not an object")
        for key, want in cls.FLAGS.items():
            if key not in (DO_REMOTE_PREFILL, DO_REMOTE_DECODE) and params.get(key) != want:
                raise InvalidParams(f"{key} is {params.get(key)!r}, expected {want!r}")
        values = {}
        for name, default, check in cls._layout():
            value = params.get(name, default)
            if value is dataclasses.MISSING or not check(value):
                raise InvalidParams(f"{name}: {'missing' if name not in params else 'bad'}")
            values[name] = value
        return cls(**values)


_S = TypeVar("_S", bound=_Shape)
_LOAD = {DO_REMOTE_PREFILL: True, DO_REMOTE_DECODE: False}
_KEEP = {DO_REMOTE_DECODE: True, DO_REMOTE_PREFILL: False}


# ---- vLLM's connectors ----
@dataclass(frozen=True)
class NixlPrefill(_Shape):
    """The prefill leg of NIXL pull/push: keep the KV; the remote fields stay null."""

    FLAGS = _KEEP
    remote_engine_id: None = None
    remote_block_ids: None = None
    remote_host: None = None
    remote_port: None = None


@dataclass(frozen=True)
class NixlAnswer(_Shape):
    """What a NIXL prefill answers that a decode side reads (vLLM adds more; the proxy copies
    the whole answer)."""

    FLAGS = _LOAD
    DROP_NONE = True
    remote_engine_id: str
    remote_request_id: str
    remote_host: str
    remote_port: Port
    remote_block_ids: BlockIds
    transfer_mode: str | None = None


@dataclass(frozen=True)
class PrefillCacheHits(_Shape):
    """Prompt tokens a prefill instance found in its own prefix cache, in its answer (when
    it says; else the answer's ``usage`` may)."""

    DROP_NONE = True
    remote_prefill_cached_tokens: int | None = None


def prefill_cached_tokens(answer: Mapping[str, Any] | None) -> int | None:
    """:class:`PrefillCacheHits` of a prefill's answer, or None."""
    try:
        return PrefillCacheHits.parse(answer or {}).remote_prefill_cached_tokens
    except InvalidParams:
        return None


@dataclass(frozen=True)
class MooncakePrefill(_Shape):
    FLAGS = {DO_REMOTE_DECODE: True}
    transfer_id: str


@dataclass(frozen=True)
class MooncakeDecode(_Shape):
    """``remote_bootstrap_addr`` is a URL: the connector queries ``+ "/query"``."""

    FLAGS = {DO_REMOTE_PREFILL: True}
    transfer_id: str
    remote_engine_id: str | None
    remote_bootstrap_addr: str


@dataclass(frozen=True)
class PrefillLeg(_Shape):
    """The prefill leg of MoRI-IO read and of ours: keep the KV (for ``transfer_id``)."""

    FLAGS = _KEEP
    DROP_NONE = True
    transfer_mode: str | None = None
    transfer_id: str | None = None


#: The leg fields every mode of ours and MoRI-IO's may carry.
_TRANSFER_MODE, _TRANSFER_ID = PrefillLeg.names()


@dataclass(frozen=True)
class MoRIIOReadAnswer(_Shape):
    """What vLLM's MoRIIOConnector answers in READ mode that a decode side needs."""

    FLAGS = _LOAD
    remote_engine_id: str
    remote_host: str
    remote_handshake_port: Port
    remote_notify_port: Port
    remote_block_ids: BlockIds
    transfer_id: str
    remote_dp_rank: int = 0
    tp_size: int = 1


@dataclass(frozen=True)
class MoRIIOWritePrefill(_Shape):
    """MoRI-IO WRITE, the prefill leg: push to the decode instance named here, whose blocks it
    allocates itself (``remote_block_ids`` empty)."""

    FLAGS = _KEEP
    transfer_id: str
    remote_engine_id: str | None
    remote_host: str
    remote_handshake_port: Port
    remote_notify_port: Port
    remote_block_ids: BlockIds = dataclasses.field(default_factory=list)


@dataclass(frozen=True)
class MoRIIOWriteDecode(MoRIIOWritePrefill):
    """MoRI-IO WRITE, the decode leg: the prefill instance named here pushes to us."""

    FLAGS = _LOAD


# ---- ours ----
_T = TypeVar("_T", bound="_Signed")


class _Signed(_Shape):
    """A shape of ours: versioned, expiring, signed under the fleet key when one is set."""

    pdext_version: int
    expires_at: float
    signature: str | None

    @classmethod
    @functools.cache
    def signed_fields(cls) -> tuple[str, ...]:
        return tuple(n for n in cls.names() if n != fleet_key.SIGNATURE)

    def signed(self, key: bytes | None) -> dict[str, Any]:
        """``params()``, with a signature under ``key`` (none without one)."""
        out = self.params()
        del out[fleet_key.SIGNATURE]
        if key is not None:
            out[fleet_key.SIGNATURE] = fleet_key.sign(key, out, self.signed_fields())
        return out

    @classmethod
    def check(cls: type[_T], params: Mapping[str, Any], key: bytes | None, now: float | None) -> _T:
        """The shape ``params`` hold, after checking (with a ``key``) its signature and, when
        ``now`` (wall clock) is given, that it has not expired; else InvalidParams."""
        version = params.get("pdext_version") if isinstance(params, Mapping) else None
        if version != VERSION:
            raise InvalidParams(
                f"contract version {version!r}; this engine speaks {VERSION} (upgrade the "
                "fleet's engines together)"
            )
        shape = cls.parse(params)
        if key is not None:
            if not fleet_key.verify(key, params, cls.signed_fields()):
                raise InvalidParams("no valid fleet-key signature")
            if now is not None and now > shape.expires_at + fleet_key.MAX_SKEW_S:
                raise InvalidParams(f"expired {now - shape.expires_at:.0f}s ago")
        return shape


@dataclass(frozen=True)
class PdExtReadAnswer(_Signed):
    """Our prefill engine's READ answer: the decode side reads ``remote_block_ids`` (one list
    per KV cache group on hybrid models) of ``remote_request_id`` from the side channel at
    ``remote_host:remote_port``, within ``lease_s`` of each renewal."""

    FLAGS = {**_LOAD, "protocol": PROTOCOL}
    remote_engine_id: str
    remote_request_id: str
    remote_host: str
    remote_port: Port
    remote_block_ids: BlockIds
    remote_num_tokens: int
    prompt_hash: str
    tp_size: int
    lease_s: float
    expires_at: float
    transfer_mode: str = READ
    pdext_version: int = VERSION
    signature: str | None = None


@dataclass(frozen=True)
class ReadSource(_Shape):
    """The prefill a READ answer names and the id its blocks are held under: enough to tell
    it to free them when the load itself is refused."""

    FLAGS = _LOAD
    remote_engine_id: str
    remote_request_id: str
    remote_host: str
    remote_port: Port


@dataclass(frozen=True)
class PdExtWriteDecode(_Signed):
    """The decode leg of our WRITE: offer blocks for ``transfer_id`` to the prefill side
    channel at ``remote_host:remote_port``, which pushes into them. It names no prompt (the
    proxy builds it before any prefill runs): the prefill's "written" notice names the hash
    of the prompt it computed, which the decode worker checks against its request's."""

    FLAGS = _LOAD
    transfer_id: str
    remote_engine_id: str | None
    remote_host: str
    remote_port: Port
    expires_at: float
    transfer_mode: str = WRITE
    pdext_version: int = VERSION
    signature: str | None = None

    @classmethod
    def build(
        cls, transfer_id: str, engine_id: str | None, host: str, port: int
    ) -> PdExtWriteDecode:
        """Fresh params, valid for ``WRITE_TTL_S``."""
        return cls(transfer_id, engine_id, host, port, time.time() + WRITE_TTL_S)
