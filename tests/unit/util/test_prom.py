from vllm_pd_ext.util.prom import parse_metrics

TEXT = """\
# HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 3.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 200.0
vllm:prompt_tokens_by_source_total{engine="1",model_name="m",source="external_kv_transfer"} 5.0
# HELP vllm:num_requests_running Number of requests running.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
"""


def test_total_filters_by_labels_and_sums():
    m = parse_metrics(TEXT)
    assert m.total("vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 205.0
    assert (
        m.total("vllm:prompt_tokens_by_source_total", source="external_kv_transfer", engine="0")
        == 200.0
    )
    assert m.total("vllm:prompt_tokens_by_source_total") == 208.0
    assert m.total("vllm:num_requests_running") == 2.0
    assert m.total("vllm:absent") == 0.0
    assert "vllm:num_requests_running" in m.names()


def test_by_label_sums_by_the_labels_values():
    m = parse_metrics(TEXT)
    name = "vllm:prompt_tokens_by_source_total"
    assert m.by_label(name, "source") == {"local_compute": 3.0, "external_kv_transfer": 205.0}
    assert m.by_label(name, "engine", "source") == {
        "0/local_compute": 3.0,
        "0/external_kv_transfer": 200.0,
        "1/external_kv_transfer": 5.0,
    }
    assert m.by_label(name, "absent") == {}  # samples lacking the label are left out
