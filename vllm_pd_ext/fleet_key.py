"""The fleet key: a secret every part of one fleet holds, so the parts can tell each other's
messages from anyone else's.

Its first use: a prefill engine's connector signs the ``kv_transfer_params`` it answers (where
a prompt's KV is: host, port, request id, blocks, prompt hash) with an HMAC-SHA256 under the
key, and a decode engine's connector loads KV only from params that carry a valid signature.
Params a client forges, or a real prefill's params with one field changed, are refused and the
prompt is computed locally.

Where the key comes from (the first that is set):

* ``VLLM_PD_FLEET_KEY_FILE``: a file holding the key (hex, at least 32 bytes of key), a regular
  file (not a symlink) owned by this user and readable by nobody else (mode 0600 or 0400);
* ``VLLM_PD_FLEET_KEY``: the key itself, hex.

Neither set: no key, nothing is signed or checked (a warning says so once per process).
``vllm-pd up`` writes a fresh key file for its stack and hands it to every engine.

Its other uses: the KV side channel's requests and answers carry a tag under the key
(:func:`tag`, with a timestamp and a nonce a :class:`ReplayGuard` remembers), and the ``tcp``
data path's HELLO is a challenge both ends answer with the key.

Imports nothing of ours: every part may use it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

KEY_FILE_ENV = "VLLM_PD_FLEET_KEY_FILE"
KEY_ENV = "VLLM_PD_FLEET_KEY"
#: Bytes of key material, at least (HMAC-SHA256's block is 64, its output 32).
MIN_KEY_BYTES = 32
#: A key file larger than this is not a key file.
MAX_KEY_FILE_BYTES = 4096
#: The field of signed params that holds the signature.
SIGNATURE = "signature"


class FleetKeyError(ValueError):
    """The configured key cannot be used (its file is unsafe, or it is not a key)."""


def _parse(text: str, source: str) -> bytes:
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        raise FleetKeyError(f"{source}: not a hex string") from None
    if len(key) < MIN_KEY_BYTES:
        raise FleetKeyError(f"{source}: {len(key)} bytes of key, at least {MIN_KEY_BYTES} needed")
    return key


def read_key_file(path: Path) -> bytes:
    """The key in ``path``, after checking that only this user can read or replace it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise FleetKeyError(f"{KEY_FILE_ENV}={path}: cannot open ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise FleetKeyError(f"{KEY_FILE_ENV}={path}: not a regular file")
        if info.st_uid != os.getuid():
            raise FleetKeyError(f"{KEY_FILE_ENV}={path}: owned by uid {info.st_uid}, not us")
        if info.st_mode & 0o077:
            raise FleetKeyError(
                f"{KEY_FILE_ENV}={path}: mode {stat.S_IMODE(info.st_mode):o} lets others read "
                "or write it (chmod 600)"
            )
        data = f.read(MAX_KEY_FILE_BYTES + 1)
    if len(data) > MAX_KEY_FILE_BYTES:
        raise FleetKeyError(f"{KEY_FILE_ENV}={path}: larger than {MAX_KEY_FILE_BYTES} bytes")
    return _parse(data.decode("ascii", "replace"), f"{KEY_FILE_ENV}={path}")


def load_key(env: Mapping[str, str] = os.environ) -> bytes | None:
    """This process's fleet key, or None when none is configured."""
    if path := env.get(KEY_FILE_ENV):
        return read_key_file(Path(path))
    if text := env.get(KEY_ENV):
        return _parse(text, KEY_ENV)
    return None


def write_key_file(path: Path) -> Path:
    """Write a fresh random key to ``path`` (which must not exist), mode 0600."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(MIN_KEY_BYTES) + "\n")
    return path


def _digest(key: bytes, params: Mapping[str, Any], fields: Sequence[str]) -> str:
    body = json.dumps({f: params.get(f) for f in fields}, sort_keys=True, separators=(",", ":"))
    return hmac.new(key, body.encode(), hashlib.sha256).hexdigest()


def sign(key: bytes, params: Mapping[str, Any], fields: Sequence[str]) -> str:
    """The signature of ``params``' ``fields`` (a missing field is signed as null): put it in
    :data:`SIGNATURE`. Fields a receiver may change in place are left out of ``fields``."""
    return _digest(key, params, fields)


def verify(key: bytes, params: Mapping[str, Any], fields: Sequence[str]) -> bool:
    """Whether ``params`` carry a valid signature of ``fields`` under ``key`` (constant-time)."""
    claimed = params.get(SIGNATURE)
    return isinstance(claimed, str) and hmac.compare_digest(claimed, _digest(key, params, fields))


def tag(key: bytes, *parts: bytes | str) -> bytes:
    """HMAC-SHA256 under ``key`` of ``parts``, each length-prefixed (so no two different lists
    of parts share a tag). Start ``parts`` with a label of what is tagged, so a tag made for
    one purpose is never valid for another."""
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        raw = part.encode() if isinstance(part, str) else part
        mac.update(len(raw).to_bytes(8, "big"))
        mac.update(raw)
    return mac.digest()


#: How far a tagged message's timestamp may be from our clock (seconds, either way).
MAX_SKEW_S = 30.0
#: Nonces a :class:`ReplayGuard` remembers at most.
MAX_NONCES = 1 << 16


class ReplayGuard:
    """Accepts each (timestamp, nonce) once, and only timestamps within ``max_skew_s`` of now.

    Bounded: it remembers at most ``max_nonces`` nonces. When it must forget one to take a new
    one, it also refuses from then on every timestamp not newer than the forgotten one's, so a
    forgotten nonce can never be replayed. Thread-safe.
    """

    def __init__(
        self,
        max_skew_s: float = MAX_SKEW_S,
        max_nonces: int = MAX_NONCES,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.max_skew_s, self.max_nonces = max_skew_s, max_nonces
        self._clock = clock
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce -> timestamp, by arrival
        self._floor = float("-inf")
        self._lock = threading.Lock()

    def check(self, timestamp: float, nonce: str) -> str | None:
        """None if the message is fresh (and remember it), else why it is refused."""
        now = self._clock()
        if abs(now - timestamp) > self.max_skew_s:
            return f"timestamp {timestamp:.0f} is {now - timestamp:+.0f}s off our clock"
        with self._lock:
            while self._seen and next(iter(self._seen.values())) < now - self.max_skew_s:
                self._seen.popitem(last=False)  # too old to be accepted again anyway
            if timestamp <= self._floor:
                return "timestamp older than nonces already forgotten"
            if nonce in self._seen:
                return "replayed (nonce seen before)"
            if len(self._seen) >= self.max_nonces:
                _, forgotten = self._seen.popitem(last=False)
                self._floor = max(self._floor, forgotten)
            self._seen[nonce] = timestamp
        return None
