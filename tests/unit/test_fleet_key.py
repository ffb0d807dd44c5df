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
