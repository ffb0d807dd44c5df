"""`vllm-pd doctor`'s advice from measured rounds (the measurements themselves run against real
engines in the integration tests)."""

from __future__ import annotations

from vllm_pd_ext.tools.doctor import Report, Round, advise, format_report


def _round(external: int, cached: int | None, computed: int | None, tokens: int = 496) -> Round:
    return Round(
        prompt_tokens=tokens,
        colocated_ttft_ms=100.0,
        prefill_leg_ms=90.0,
        decode_first_token_ms=20.0,
        external_tokens=external,
        connector_xfer_ms=5.0,
        connector_bytes=1e6,
        local_cache_hit_tokens=cached,
        recomputed_tokens=computed,
    )


def _report(*rounds: Round) -> Report:
    return Report("m", "p", "d", 1024, "note", "none", list(rounds))


def test_a_prompt_loaded_partly_from_the_decodes_own_cache_is_not_called_recomputed():
    """The decode side found 384 tokens in its own prefix cache and loaded the other 111 over
    the transfer: nothing was recomputed, so the doctor must not say so."""
    advice = advise(_report(_round(111, 384, 1), _round(495, 0, 1)), None)
    assert not any("NOT loaded" in a for a in advice)


def test_a_prompt_the_decode_side_computed_is_reported():
    advice = advise(_report(_round(0, 0, 496), _round(495, 0, 1)), None)
    assert any(a.startswith("1 of 2 prompts were NOT loaded") for a in advice)


def test_without_counts_by_source_the_external_tokens_decide():
    assert any("NOT loaded" in a for a in advise(_report(_round(100, None, None)), None))
    assert not any("NOT loaded" in a for a in advise(_report(_round(495, None, None)), None))


def test_the_table_shows_where_the_decodes_prompt_tokens_came_from():
    table = format_report(_report(_round(111, 384, 1), _round(495, None, None)))
    rows = [line.split() for line in table.splitlines() if line.lstrip().startswith("496")]
    assert [row[5:8] for row in rows] == [["111", "384", "1"], ["495", "-", "-"]]
