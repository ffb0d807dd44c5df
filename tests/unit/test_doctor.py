"""`vllm-pd doctor`'s advice from measured rounds (the measurements themselves run against real
engines in the integration tests)."""

from __future__ import annotations

from vllm_pd_ext.tools.doctor import Report, Round, advise, format_report
from vllm_pd_ext.tools.engine_checks import CounterMove, EngineIdle


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


def test_counters_that_rose_and_engines_busy_while_idle_lead_the_advice():
    report = _report(_round(495, 0, 1))
    report.kv_counter_moves = [
        CounterMove("prefill", "p", "vllm:pdext_kv_lease_expiries_total", 1, "freed unread")
    ]
    report.idle = [
        EngineIdle("prefill", "p", 94.0, busy_threads=("python (7): 94%",), connector="nixl"),
        EngineIdle("decode", "d", 1.5, connector="nixl"),
    ]
    advice = advise(report, None)
    assert advice[0] == "prefill p: vllm:pdext_kv_lease_expiries_total rose by 1: freed unread"
    assert advice[1].startswith("prefill p busy-polls: 94% of a core while idle")
    assert not any(a.startswith("decode d busy-polls") for a in advice)
    assert not any("busy-polls" in a for a in advise(report, None, busy_pct=95.0))


def test_the_report_shows_each_engines_idle_cpu():
    report = _report(_round(495, 0, 1))
    report.idle = [
        EngineIdle("prefill", "p", 2.5),
        EngineIdle("decode", "http://10.9.9.9:8000", None, "not on this host"),
    ]
    lines = format_report(report).splitlines()
    assert "  prefill p: idle CPU 2.5% of a core" in lines
    assert "  decode http://10.9.9.9:8000: idle CPU n/a (not on this host)" in lines
