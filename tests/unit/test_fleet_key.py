"""The fleet key: where it is read from, what is refused, and what a signature covers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vllm_pd_ext import fleet_key
from vllm_pd_ext.fleet_key import FleetKeyError, load_key, sign, verify, write_key_file

FIELDS = ("remote_host", "remote_port", "remote_block_ids")
PARAMS = {"remote_host": "127.0.0.1", "remote_port": 7000, "remote_block_ids": [1, 2, 3]}


def test_a_written_key_file_is_private_and_loads(tmp_path):
    path = write_key_file(tmp_path / "fleet.key")
    assert path.stat().st_mode & 0o777 == 0o600
    key = load_key({fleet_key.KEY_FILE_ENV: str(path)})
    assert key is not None and len(key) == fleet_key.MIN_KEY_BYTES
    with pytest.raises(FileExistsError):  # never overwrites: a planted file is not reused
        write_key_file(path)


def test_key_file_others_can_read_is_refused(tmp_path):
    path = write_key_file(tmp_path / "fleet.key")
    path.chmod(0o644)
    with pytest.raises(FleetKeyError, match="chmod 600"):
        load_key({fleet_key.KEY_FILE_ENV: str(path)})


def test_key_file_symlink_is_refused(tmp_path):
    real = write_key_file(tmp_path / "real.key")
    link = tmp_path / "fleet.key"
    link.symlink_to(real)
    with pytest.raises(FleetKeyError, match="cannot open"):
        load_key({fleet_key.KEY_FILE_ENV: str(link)})


@pytest.mark.parametrize(("text", "why"), [("ab" * 16, "at least 32"), ("not hex", "not a hex")])
def test_short_or_malformed_keys_are_refused(tmp_path, text, why):
    with pytest.raises(FleetKeyError, match=why):
        load_key({fleet_key.KEY_ENV: text})
    path = tmp_path / "fleet.key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, text.encode())
    os.close(fd)
    with pytest.raises(FleetKeyError, match=why):
        load_key({fleet_key.KEY_FILE_ENV: str(path)})


def test_no_key_configured_is_none():
    assert load_key({}) is None
    assert load_key({fleet_key.KEY_ENV: "", fleet_key.KEY_FILE_ENV: ""}) is None


def test_the_file_wins_over_the_variable(tmp_path):
    path = write_key_file(tmp_path / "fleet.key")
    key = load_key({fleet_key.KEY_FILE_ENV: str(path), fleet_key.KEY_ENV: "ab" * 32})
    assert key == bytes.fromhex(Path(path).read_text())


def test_a_signature_covers_each_signed_field_and_only_those():
    key = bytes.fromhex("ab" * 32)
    signed = {**PARAMS, "do_remote_prefill": True, "signature": sign(key, PARAMS, FIELDS)}
    assert verify(key, signed, FIELDS)
    assert verify(key, {**signed, "do_remote_prefill": False}, FIELDS)  # not signed: may change
    for field in FIELDS:
        assert not verify(key, {**signed, field: "changed"}, FIELDS), field
        assert not verify(key, {k: v for k, v in signed.items() if k != field}, FIELDS), field
    assert not verify(bytes.fromhex("cd" * 32), signed, FIELDS)
    assert not verify(key, {**signed, "signature": None}, FIELDS)
    assert not verify(key, PARAMS, FIELDS)


def test_tags_depend_on_every_part_and_its_boundaries():
    key = bytes(32)
    base = fleet_key.tag(key, "label", b"ab", "c")
    assert base == fleet_key.tag(key, "label", "ab", b"c")  # str parts are their UTF-8
    assert base != fleet_key.tag(key, "label", b"a", b"bc")  # moved boundary
    assert base != fleet_key.tag(key, "other", b"ab", b"c")
    assert base != fleet_key.tag(bytes(range(32)), "label", b"ab", b"c")


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_replay_guard_takes_each_nonce_once_and_only_fresh_timestamps():
    clock = _Clock()
    guard = fleet_key.ReplayGuard(max_skew_s=30, clock=clock)
    assert guard.check(1000.0, "a") is None
    assert "replayed" in (guard.check(1000.0, "a") or "")
    assert "off our clock" in (guard.check(960.0, "b") or "")
    assert "off our clock" in (guard.check(1040.0, "b") or "")
    assert guard.check(1029.0, "b") is None


def test_replay_guard_is_bounded_and_never_forgets_a_nonce_it_could_still_accept():
    """Full, it forgets its oldest nonce, and from then on refuses every timestamp up to that
    one's: the forgotten nonce's message cannot be replayed."""
    clock = _Clock()
    guard = fleet_key.ReplayGuard(max_skew_s=30, max_nonces=3, clock=clock)
    for i, stamp in enumerate((995.0, 996.0, 997.0)):
        assert guard.check(stamp, f"n{i}") is None
    assert guard.check(998.0, "n3") is None  # forgets n0 (995)
    assert guard.check(995.0, "n0") is not None  # the forgotten one, replayed
    assert guard.check(994.0, "older") is not None
    assert guard.check(999.0, "n4") is None
    assert len(guard._seen) == 3
    clock.now = 1100.0  # every nonce is past the window: dropped, nothing refused wrongly
    assert guard.check(1100.0, "n5") is None
    assert list(guard._seen) == ["n5"]
