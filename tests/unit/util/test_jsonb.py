"""``jsonb.loads``: ``json.loads`` of bytes, the same value and the same error for every
body, the usual UTF-8 object without the encoding guess."""

from __future__ import annotations

import json

import pytest

from vllm_pd_ext.util import jsonb

BODIES = [
    b'{"a":[1,2.5,"\xc3\xa9"],"b":null}',
    b'{"a": "\\ud800"}',  # a lone surrogate, as json.loads lets through
    b"{}",
    b"{",
    b'{"a":1} x',
    b'{"a":"\xff"}',  # not UTF-8
    '{"a":"é"}'.encode("utf-16-le"),
    '{"a":"é"}'.encode("utf-16"),
    '{"a":"é"}'.encode("utf-8-sig"),
    b"[1,2]",
    b" {}",
    b"",
]


def _outcome(loads, raw: bytes) -> object:
    try:
        return loads(raw)
    except ValueError as exc:
        return (type(exc), str(exc))


@pytest.mark.parametrize("raw", BODIES)
def test_loads_gives_what_json_loads_gives(raw):
    assert _outcome(jsonb.loads, raw) == _outcome(json.loads, raw)
