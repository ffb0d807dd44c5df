"""Reading an engine's load from its /metrics text."""

from __future__ import annotations

from vllm_pd_ext.proxy.config import InstanceConfig
from vllm_pd_ext.proxy.fleet import Fleet, Instance
from vllm_pd_ext.proxy.upstream import Upstream

METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 7.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3"} 1.0
vllm:e2e_request_latency_seconds_count{engine="0"} 1.0
"""


def test_load_comes_from_the_three_gauges_only():
    inst = Instance(
        InstanceConfig(url="http://e:1"), client=Upstream("http://e:1", max_connections=1)
    )
    Fleet._read_load(inst, METRICS.encode())
    assert (inst.running, inst.waiting, inst.kv_usage) == (3.0, 2.0, 0.25)
    assert inst.load() == 3.0 + 2 * 2.0
    Fleet._read_load(inst, b"garbage {{{")  # a bad scrape keeps the last values
    assert inst.running == 3.0
    # a sample on the very first line, two engines' samples summed, no trailing newline
    first = b'vllm:num_requests_running{engine="0"} 1.0\nvllm:num_requests_running{engine="1"} 4.0'
    Fleet._read_load(inst, first)
    assert inst.running == 5.0


def test_prefix_caching_comes_from_vllms_cache_config_info():
    """vLLM writes its CacheConfig as the labels of ``vllm:cache_config_info`` (a gauge set
    to 1): the fleet reads ``enable_prefix_caching`` from it, and says nothing without it."""
    inst = Instance(
        InstanceConfig(url="http://e:1"), client=Upstream("http://e:1", max_connections=1)
    )
    Fleet._read_load(inst, METRICS.encode())
    assert inst.prefix_caching is None
    for value, expected in (("False", False), ("True", True)):
        info = (
            "# TYPE vllm:cache_config_info gauge\n"
            'vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales='
            f'"False",enable_prefix_caching="{value}",engine="0",gpu_memory_utilization="0.9",'
            'prefix_caching_hash_algo="sha256"} 1.0\n'
        )
        Fleet._read_load(inst, (METRICS + info).encode())
        assert inst.prefix_caching is expected
        assert inst.running == 3.0
