"""PdExtMoRIIOConnector over our ``tcp`` transport backend on two real `vllm serve`: both modes
give colocated output and load the prompt (a module of its own, so only two engines run at once).
"""

from __future__ import annotations

import httpx
import pytest

from tests.integration.fleet_helpers import pdext_pair, split_read, split_write, wait_idle
from vllm_pd_ext.tools.pd_demo import completion_body, make_prompt_ids, stream_completion
from vllm_pd_ext.util.prom import EXTERNAL_KV, PROMPT_TOKENS_BY_SOURCE

pytestmark = pytest.mark.integration


def test_over_our_tcp_backend(vllm_servers, tiny_qwen):
    """The same connector over the ``tcp`` transport backend, both modes (its own pair)."""
    prefill, decode, side = pdext_pair(vllm_servers, tiny_qwen, "moriio-tcp", backend="tcp")
    try:
        prompt_ids = make_prompt_ids(tiny_qwen, 300)
        with httpx.Client(timeout=httpx.Timeout(120.0, connect=5.0)) as client:
            body = completion_body(prefill, prompt_ids, 16)
            colocated, _ = stream_completion(client, prefill, body)
            before = decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV)
            assert split_read(client, prefill, decode, prompt_ids, 16) == colocated
            assert split_write(client, prefill, decode, side, prompt_ids, 16) == colocated
        assert decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV) - before >= 2 * 299
        wait_idle(prefill)
    finally:
        prefill.stop()
        decode.stop()
