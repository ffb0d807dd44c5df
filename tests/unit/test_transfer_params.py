"""The kv_transfer_params contract: shapes round-trip, malformed params are refused with the
field named, and our signed shapes bind their version and expiry."""

from __future__ import annotations

import math

import pytest

from vllm_pd_ext import fleet_key
from vllm_pd_ext.transfer_params import (
    MAX_BLOCK_IDS,
    VERSION,
    InvalidParams,
    MooncakeDecode,
    MoRIIOWriteDecode,
    NixlAnswer,
    PdExtReadAnswer,
    PdExtWriteDecode,
    PrefillLeg,
    loads_remote,
    mark_loaded,
    prefill_cached_tokens,
)

KEY = bytes.fromhex("ab" * 32)
NOW = 1_800_000_000.0


def read_answer(**changes) -> PdExtReadAnswer:
    fields = {
        "remote_engine_id": "p0",
        "remote_request_id": "req-1",
        "remote_host": "10.0.0.2",
        "remote_port": 5600,
        "remote_block_ids": [[1, 2, 3], [9]],
        "remote_num_tokens": 40,
        "prompt_hash": "00ff",
        "tp_size": 1,
        "lease_s": 30.0,
        "expires_at": NOW + 30,
    }
    return PdExtReadAnswer(**{**fields, **changes})


def test_every_shape_round_trips():
    shapes = [
        read_answer(signature=None),
        PdExtWriteDecode("t" * 32, None, "h", 1, NOW),
        MooncakeDecode("t", "p0", "http://h:1"),
        MoRIIOWriteDecode("t", "p0", "h", 1, 2),
        NixlAnswer("p0", "r", "h", 1, [1, 2]),
    ]
    for shape in shapes:
        assert type(shape).parse(shape.params()) == shape


@pytest.mark.parametrize(
    "field, value",
    [
        ("remote_port", 0),
        ("remote_port", 65536),
        ("remote_port", "5600"),
        ("remote_port", True),  # a bool is no port, though Python calls it an int
        ("remote_host", ""),
        ("remote_host", None),
        ("remote_block_ids", [1, "2"]),
        ("remote_block_ids", [[1], [2.5]]),
        ("remote_block_ids", list(range(MAX_BLOCK_IDS + 1))),
        ("remote_block_ids", [[]] * (MAX_BLOCK_IDS + 1)),
        ("lease_s", math.nan),
        ("remote_num_tokens", 40.0),
    ],
)
def test_a_malformed_field_is_refused_by_name(field, value):
    params = read_answer().params()
    params[field] = value
    with pytest.raises(InvalidParams, match=field):
        PdExtReadAnswer.parse(params)


def test_a_missing_field_is_refused_by_name():
    params = read_answer().params()
    del params["prompt_hash"]
    with pytest.raises(InvalidParams, match="prompt_hash: missing"):
        PdExtReadAnswer.parse(params)


def test_another_version_is_refused_before_anything_else():
    params = {**read_answer().params(), "pdext_version": VERSION - 1}
    with pytest.raises(InvalidParams, match="contract version"):
        PdExtReadAnswer.check(params, None, None)


def test_with_a_key_only_fresh_signed_params_pass():
    signed = read_answer().signed(KEY)
    assert PdExtReadAnswer.check(signed, KEY, NOW).remote_request_id == "req-1"
    # within the clock skew allowed past expiry: still fresh
    assert PdExtReadAnswer.check(signed, KEY, NOW + 30 + fleet_key.MAX_SKEW_S)
    with pytest.raises(InvalidParams, match="expired"):
        PdExtReadAnswer.check(signed, KEY, NOW + 31 + fleet_key.MAX_SKEW_S)
    with pytest.raises(InvalidParams, match="signature"):
        PdExtReadAnswer.check({**signed, "expires_at": NOW + 3600}, KEY, NOW)
    with pytest.raises(InvalidParams, match="signature"):
        PdExtReadAnswer.check(read_answer().signed(None), KEY, NOW)


def test_the_flags_a_connector_flips_leave_the_signature_valid():
    signed = read_answer().signed(KEY)
    assert loads_remote(signed)
    mark_loaded(signed)
    assert not loads_remote(signed)
    assert PdExtReadAnswer.check(signed, KEY, None)


def test_prefill_legs_carry_only_what_is_set():
    assert PrefillLeg(transfer_mode="read").params() == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "transfer_mode": "read",
    }


def test_prefill_cache_hits_are_read_only_when_well_formed():
    assert prefill_cached_tokens({"remote_prefill_cached_tokens": 3}) == 3
    assert prefill_cached_tokens({"remote_prefill_cached_tokens": "3"}) is None
    assert prefill_cached_tokens(None) is None
