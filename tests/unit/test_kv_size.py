"""kv-size against the disaggregation guide's figures and hand-computed cache sizes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import requires_vllm
from vllm_pd_ext.tools.kv_size import (
    ConfigError,
    compute_kv_size,
    ideal_transfer_seconds,
    load_config,
)

CONFIGS = Path(__file__).parent.parent / "fixtures" / "configs"
KIB = 1024


def size_of(name: str, **kwargs):
    return compute_kv_size(load_config(CONFIGS / f"{name}.json"), **kwargs)


def test_llama_70b_matches_guide():
    size = size_of("llama-3.1-70b")
    assert size.dtype == "bfloat16"
    assert size.bytes_per_token == 320 * KIB
    kv = size.kv_bytes_for(10_000)
    assert round(kv / 1e9, 1) == 3.3  # "10k tokens ~3.3 GB"
    assert round(ideal_transfer_seconds(kv, 400) * 1e3) == 66  # "~65 ms at 400 Gb/s"
    assert 65.0 <= ideal_transfer_seconds(kv, 400) * 1e3 < 66.0
    assert size.states == ()


def test_qwen25_7b_matches_guide():
    size = size_of("qwen2.5-7b")
    assert size.bytes_per_token == 56 * KIB
    assert round(size.kv_bytes_for(8192) / 1e6) == 470  # "8k tokens ~470 MB"
    # use_sliding_window is false: no layer is clipped even past the (unused) window.
    assert [g.kind for g in size.attention] == ["full"]


def test_dtype_override_scales_bytes():
    assert size_of("llama-3.1-70b", dtype="fp8").bytes_per_token == 160 * KIB
    assert size_of("llama-3.1-70b", dtype="float32").bytes_per_token == 640 * KIB


def test_mla_latent_per_layer():
    size = size_of("deepseek-v3")
    (group,) = size.attention
    assert group.kind == "mla"
    assert group.bytes_per_token_per_layer == (512 + 64) * 2
    assert size.bytes_per_token == 61 * 576 * 2


def test_mistral_every_layer_slides():
    size = size_of("mistral-7b-v0.1")
    (group,) = size.attention
    assert (group.kind, group.count, group.window) == ("sliding", 32, 4096)
    assert size.bytes_per_token == 128 * KIB
    assert size.kv_bytes_for(8192) == 128 * KIB * 4096  # clipped to the window
    assert size.kv_bytes_for(1000) == 128 * KIB * 1000


def test_gemma2_alternates_and_model_dtype_is_default():
    assert size_of("gemma-2-9b").dtype == "float32"
    size = size_of("gemma-2-9b", dtype="bf16")
    kinds = {g.kind: g.count for g in size.attention}
    assert kinds == {"full": 21, "sliding": 21}
    per_layer = 2 * 8 * 256 * 2
    assert size.bytes_per_token == 42 * per_layer
    assert size.kv_bytes_for(8192) == 21 * per_layer * 8192 + 21 * per_layer * 4096


def test_gemma3_text_config_and_pattern():
    size = size_of("gemma-3-12b")
    kinds = {g.kind: g.count for g in size.attention}
    assert kinds == {"full": 8, "sliding": 40}
    per_layer = 2 * 8 * 256 * 2
    assert size.kv_bytes_for(32768) == 8 * per_layer * 32768 + 40 * per_layer * 1024


def test_gpt_oss_layer_types():
    size = size_of("gpt-oss-20b")
    kinds = {g.kind: (g.count, g.window) for g in size.attention}
    assert kinds == {"full": (12, None), "sliding": (12, 128)}
    assert size.bytes_per_token == 24 * 2 * 8 * 64 * 2


def test_pure_mamba2_has_state_and_no_kv():
    size = size_of("mamba-codestral-7b")
    assert size.bytes_per_token == 0
    (state,) = size.states
    conv = 3 * (8192 + 2 * 8 * 128)
    ssm = 128 * 64 * 128
    assert state.bytes_per_layer == (conv + ssm) * 2
    assert size.state_bytes_per_sequence == 64 * (conv + ssm) * 2
    f32 = size_of("mamba-codestral-7b", ssm_dtype="float32")
    assert f32.states[0].bytes_per_layer == conv * 2 + ssm * 4


def test_jamba_mamba1_and_attention():
    size = size_of("jamba-v0.1")
    assert size.attention[0].count == 4
    assert size.bytes_per_token == 4 * 2 * 8 * 128 * 2
    (state,) = size.states
    assert (state.kind, state.count) == ("mamba1", 28)
    assert state.bytes_per_layer == (3 * 8192 + 8192 * 16) * 2


def test_qwen3_next_gated_delta_net():
    size = size_of("qwen3-next-80b-a3b")
    assert size.attention[0].count == 12
    assert size.bytes_per_token == 12 * 2 * 2 * 256 * 2
    (state,) = size.states
    assert (state.kind, state.count) == ("gated_delta_net", 36)
    conv = 3 * (2 * 16 * 128 + 32 * 128)
    assert state.bytes_per_layer == (conv + 32 * 128 * 128) * 2


def test_granite_hybrid_layer_types():
    size = size_of("granite-4.0-h-tiny")
    assert size.attention[0].count == 4
    assert size.bytes_per_token == 4 * 2 * 4 * 128 * 2
    (state,) = size.states
    assert state.count == 36
    assert state.bytes_per_layer == (3 * (3072 + 2 * 128) + 48 * 64 * 128) * 2


def test_nemotron_h_pattern_counts():
    size = size_of("nemotron-h-8b")
    pattern = load_config(CONFIGS / "nemotron-h-8b.json")["hybrid_override_pattern"]
    assert size.attention[0].count == pattern.count("*")
    assert size.states[0].count == pattern.count("M")
    assert size.num_layers == 52


def test_falcon_h1_and_zamba2_hold_both_per_layer():
    falcon = size_of("falcon-h1-1.5b")
    assert falcon.attention[0].count == 24 and falcon.states[0].count == 24
    zamba = size_of("zamba2-1.2b")
    assert zamba.attention[0].count == 6 and zamba.states[0].count == 38
    # Zamba2's shared attention runs on 2 x hidden: head_dim = 2 * 2048 / 32.
    assert zamba.attention[0].bytes_per_token_per_layer == 2 * 32 * 128 * 2


def test_transfer_bytes_add_state_to_kv():
    size = size_of("jamba-v0.1")
    assert size.transfer_bytes_for(100) == size.kv_bytes_for(100) + size.state_bytes_per_sequence


@requires_vllm
@pytest.mark.parametrize(
    "name",
    [
        "mamba-codestral-7b",
        "granite-4.0-h-tiny",
        "nemotron-h-8b",
        "falcon-h1-1.5b",
        "zamba2-1.2b",
        "jamba-v0.1",
        "qwen3-next-80b-a3b",
    ],
)
def test_state_sizes_agree_with_vllm(name):
    """Cross-check our state shapes with vLLM's own MambaStateShapeCalculator."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator as calc

    cfg = load_config(CONFIGS / f"{name}.json")
    hidden = cfg["hidden_size"]
    mt = cfg["model_type"]
    if mt == "jamba":
        shapes = calc.mamba1_state_shape(
            1, cfg["mamba_expand"] * hidden, cfg["mamba_d_state"], cfg["mamba_d_conv"]
        )
    elif mt == "qwen3_next":
        shapes = calc.gated_delta_net_state_shape(
            1,
            cfg["linear_num_key_heads"],
            cfg["linear_num_value_heads"],
            cfg["linear_key_head_dim"],
            cfg["linear_value_head_dim"],
            cfg["linear_conv_kernel_dim"],
        )
    else:
        args = {
            "mamba2": ("expand", "n_groups", "num_heads", "head_dim", "state_size", "conv_kernel"),
            "nemotron_h": (
                None,
                "n_groups",
                "mamba_num_heads",
                "mamba_head_dim",
                "ssm_state_size",
                "conv_kernel",
            ),
            "zamba2": (
                "mamba_expand",
                "mamba_ngroups",
                "n_mamba_heads",
                "mamba_headdim",
                "mamba_d_state",
                "mamba_d_conv",
            ),
        }.get(
            mt,
            (
                "mamba_expand",
                "mamba_n_groups",
                "mamba_n_heads",
                "mamba_d_head",
                "mamba_d_state",
                "mamba_d_conv",
            ),
        )
        expand, groups, heads, head_dim, state, kernel = args
        if mt == "nemotron_h":
            inter = cfg["mamba_num_heads"] * cfg["mamba_head_dim"]
        elif cfg.get("mamba_d_ssm") is not None:
            inter = cfg["mamba_d_ssm"]
        else:
            assert expand is not None  # only nemotron_h has no expand key
            inter = cfg[expand] * hidden
        shapes = calc.mamba2_state_shape(
            1, inter, cfg[groups], cfg[heads], cfg[head_dim], cfg[state], cfg[kernel]
        )
    expected = 0
    for shape in shapes:
        n = 1
        for d in shape:
            n *= d
        expected += n * 2  # bf16 conv and (auto) SSM state
    assert size_of(name).states[0].bytes_per_layer == expected


def test_bad_configs_raise_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"no config\.json"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        compute_kv_size({"model_type": "llama", "hidden_size": 64})
    with pytest.raises(ConfigError, match="unknown dtype"):
        compute_kv_size(load_config(CONFIGS / "llama-3.1-70b.json"), dtype="int3")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vllm_pd_ext.cli", "kv-size", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_json_has_documented_fields():
    proc = run_cli(
        str(CONFIGS / "llama-3.1-70b.json"), "--tokens", "10000", "--link-gbps", "400", "--json"
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["bytes_per_token"] == 327680
    assert out["kv_bytes_for_prompt"] == 3_276_800_000
    assert out["ideal_transfer_seconds"] == pytest.approx(0.065536)
    assert "state_bytes_per_sequence" not in out


def test_cli_hybrid_json_lists_state(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text((CONFIGS / "jamba-v0.1.json").read_text())
    proc = run_cli(str(model_dir), "--json")  # a directory works as well as the file
    out = json.loads(proc.stdout)
    assert out["state_bytes_per_sequence"] == 28 * (3 * 8192 + 8192 * 16) * 2
    assert out["state_layers"][0]["kind"] == "mamba1"


def test_cli_text_report_and_error_exit(tmp_path):
    proc = run_cli(str(CONFIGS / "qwen2.5-7b.json"), "--link-gbps", "100")
    assert proc.returncode == 0
    assert "56.0 KiB" in proc.stdout
    assert "ideal transfer at 100 Gb/s" in proc.stdout
    bad = run_cli(str(tmp_path))
    assert bad.returncode == 2
    assert "no config.json" in bad.stderr
    neg = run_cli(str(CONFIGS / "qwen2.5-7b.json"), "--tokens", "0")
    assert neg.returncode == 2 and "positive" in neg.stderr
