"""KV-cache size calculator: bytes per token, per prompt and per transfer, from a config.json.

Pure Python on the Hugging Face ``config.json`` (no torch, vLLM or transformers), so it runs
anywhere. It follows how vLLM sizes its caches:

* full attention: ``2 (K and V) x kv_heads x head_dim x dtype`` per token per layer (GQA/MQA
  through ``num_key_value_heads``);
* MLA (DeepSeek-V2/V3 style): one latent of ``kv_lora_rank + qk_rope_head_dim`` per token per
  layer, no separate K and V;
* sliding-window layers: same bytes per token, but a prompt only keeps ``window`` tokens;
* SSM / linear-attention layers (Mamba1, Mamba2, gated delta net): a fixed state per sequence
  (conv state + temporal state), listed separately from the per-token attention KV.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

#: Bytes per element for the dtypes a KV cache or state can use.
DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}

DTYPE_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
}


class ConfigError(ValueError):
    """The config lacks a field the calculation needs, or has one we cannot interpret."""


@dataclass(frozen=True)
class LayerGroup:
    """Layers of one kind that hold per-token KV."""

    kind: str  # "full", "sliding" or "mla"
    count: int
    bytes_per_token_per_layer: int
    window: int | None = None
    detail: str = ""

    def bytes_for(self, tokens: int) -> int:
        kept = tokens if self.window is None else min(tokens, self.window)
        return self.count * self.bytes_per_token_per_layer * kept


@dataclass(frozen=True)
class StateGroup:
    """Layers of one kind that hold a fixed-size recurrent state per sequence."""

    kind: str  # "mamba1", "mamba2" or "gated_delta_net"
    count: int
    bytes_per_layer: int
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]


@dataclass(frozen=True)
class KVSize:
    """What one model's caches cost, at the chosen dtypes."""

    model_type: str
    architecture: str
    dtype: str
    num_layers: int
    attention: tuple[LayerGroup, ...]
    states: tuple[StateGroup, ...] = field(default=())

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        """Attention KV of one token over all attention layers (windows not applied)."""
        return sum(g.count * g.bytes_per_token_per_layer for g in self.attention)

    @property
    def state_bytes_per_sequence(self) -> int:
        return sum(g.count * g.bytes_per_layer for g in self.states)

    def kv_bytes_for(self, tokens: int) -> int:
        """Attention KV of a ``tokens``-long prompt, sliding-window layers clipped."""
        return sum(g.bytes_for(tokens) for g in self.attention)

    def transfer_bytes_for(self, tokens: int) -> int:
        """Everything a prefill instance hands a decode instance for one such prompt."""
        return self.kv_bytes_for(tokens) + self.state_bytes_per_sequence

    def to_json(self, tokens: int, link_gbps: float | None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model_type": self.model_type,
            "architecture": self.architecture,
            "dtype": self.dtype,
            "dtype_bytes": self.dtype_bytes,
            "num_layers": self.num_layers,
            "bytes_per_token": self.bytes_per_token,
            "attention_layers": [asdict(g) for g in self.attention],
            "prompt_tokens": tokens,
            "kv_bytes_for_prompt": self.kv_bytes_for(tokens),
            "transfer_bytes": self.transfer_bytes_for(tokens),
        }
        if self.states:
            out["state_bytes_per_sequence"] = self.state_bytes_per_sequence
            out["state_layers"] = [asdict(g) for g in self.states]
        if link_gbps is not None:
            out["link_gbps"] = link_gbps
            out["ideal_transfer_seconds"] = ideal_transfer_seconds(
                self.transfer_bytes_for(tokens), link_gbps
            )
        return out


def ideal_transfer_seconds(num_bytes: int, link_gbps: float) -> float:
    """Seconds to move ``num_bytes`` at ``link_gbps`` gigabits per second with zero overhead."""
    if link_gbps <= 0:
        raise ValueError("link speed must be positive")
    return num_bytes * 8 / (link_gbps * 1e9)


def normalize_dtype(name: str) -> str:
    key = str(name).lower().removeprefix("torch.")
    key = DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        choices = ", ".join(sorted({*DTYPE_BYTES, *DTYPE_ALIASES}))
        raise ConfigError(f"unknown dtype {name!r}; choose one of: {choices}")
    return key


def load_config(path: str | Path) -> dict[str, Any]:
    """Read a ``config.json`` given its path or the model directory that holds it."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ConfigError(f"no config.json at {p}") from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{p} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{p} does not hold a JSON object")
    return data


class _Cfg:
    """Field access over a config dict with the aliases older configs use."""

    ALIASES = {
        "num_hidden_layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
        "num_attention_heads": ("num_attention_heads", "n_head", "num_heads", "n_heads"),
        "hidden_size": ("hidden_size", "n_embd", "d_model"),
    }

    def __init__(self, data: dict[str, Any]):
        text = data.get("text_config")
        self.data = {**data, **text} if isinstance(text, dict) else data

    def get(self, key: str, default: Any = None) -> Any:
        for name in self.ALIASES.get(key, (key,)):
            value = self.data.get(name)
            if value is not None:
                return value
        return default

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ConfigError(f"config.json has no {key!r}, needed for this model type")
        return value

    def need_int(self, key: str) -> int:
        value = self.need(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ConfigError(f"config.json field {key!r} must be a non-negative number")
        return int(value)


def _model_dtype(cfg: _Cfg) -> str:
    raw = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    try:
        return normalize_dtype(raw)
    except ConfigError:
        return "bfloat16"


def _layer_kinds(cfg: _Cfg) -> list[str]:
    """One entry per decoder layer: "attn", "sliding", "mamba1", "mamba2", "gdn", "none".

    FalconH1 layers hold attention and Mamba2 side by side: those are "attn+mamba2".
    """
    model_type = str(cfg.get("model_type", ""))
    n = cfg.need_int("num_hidden_layers")

    if model_type in ("mamba", "falcon_mamba"):
        return ["mamba1"] * n
    if model_type == "mamba2":
        return ["mamba2"] * n
    if model_type == "falcon_h1":
        return ["attn+mamba2"] * n
    if model_type == "jamba":
        period = cfg.need_int("attn_layer_period")
        offset = cfg.need_int("attn_layer_offset")
        return ["attn" if i % period == offset else "mamba1" for i in range(n)]
    pattern = cfg.get("hybrid_override_pattern")
    if isinstance(pattern, str) and pattern:  # NemotronH: M = Mamba2, * = attention
        if len(pattern) != n:
            raise ConfigError("hybrid_override_pattern length differs from num_hidden_layers")
        return [{"M": "mamba2", "*": "attn"}.get(c, "none") for c in pattern]
    block_types = cfg.get("layers_block_type")
    if isinstance(block_types, list) and block_types:  # Zamba2: mamba | hybrid (+attention)
        return ["attn+mamba2" if t == "hybrid" else "mamba2" for t in block_types]

    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list) and layer_types:
        mapping = {
            "attention": "attn",
            "full_attention": "attn",
            "sliding_attention": "sliding",
            "mamba": "mamba2",
            "linear_attention": "gdn",
        }
        if len(layer_types) != n:
            raise ConfigError("layer_types length differs from num_hidden_layers")
        unknown = sorted({t for t in layer_types if t not in mapping})
        if unknown:
            raise ConfigError(f"unsupported layer_types entries: {', '.join(unknown)}")
        return [mapping[t] for t in layer_types]

    interval = cfg.get("full_attention_interval")
    if model_type.startswith("qwen3_next") and isinstance(interval, int) and interval > 0:
        return ["attn" if (i + 1) % interval == 0 else "gdn" for i in range(n)]

    window = cfg.get("sliding_window")
    if window is None or cfg.get("use_sliding_window") is False:
        return ["attn"] * n
    pattern_n = cfg.get("sliding_window_pattern")
    if isinstance(pattern_n, int) and pattern_n > 0:  # every Nth layer is global
        return ["attn" if (i + 1) % pattern_n == 0 else "sliding" for i in range(n)]
    if model_type == "gemma2":  # even layers slide
        return ["sliding" if i % 2 == 0 else "attn" for i in range(n)]
    max_window_layers = cfg.get("max_window_layers")
    if model_type.startswith("qwen") and isinstance(max_window_layers, int):
        return ["sliding" if i >= max_window_layers else "attn" for i in range(n)]
    return ["sliding"] * n  # Mistral-style: every layer slides


def _attention_group(cfg: _Cfg, kind: str, count: int, dtype_bytes: int) -> LayerGroup:
    if cfg.get("kv_lora_rank") is not None:
        rank = cfg.need_int("kv_lora_rank")
        rope = cfg.need_int("qk_rope_head_dim")
        return LayerGroup(
            kind="mla",
            count=count,
            bytes_per_token_per_layer=(rank + rope) * dtype_bytes,
            detail=f"latent {rank} + rope {rope}",
        )
    heads = cfg.need_int("num_attention_heads")
    kv_heads = cfg.get("num_key_value_heads") or cfg.get("num_kv_heads")
    if kv_heads is None and cfg.get("multi_query"):
        kv_heads = 1
    kv_heads = int(kv_heads or heads)
    if cfg.get("model_type") == "zamba2":  # attention runs on concatenated 2x hidden
        head_dim = cfg.get("attention_head_dim") or 2 * cfg.need_int("hidden_size") // heads
    else:
        head_dim = cfg.get("head_dim") or cfg.need_int("hidden_size") // heads
    head_dim = int(head_dim)
    window = cfg.need_int("sliding_window") if kind == "sliding" else None
    return LayerGroup(
        kind="sliding" if kind == "sliding" else "full",
        count=count,
        bytes_per_token_per_layer=2 * kv_heads * head_dim * dtype_bytes,
        window=window,
        detail=f"{kv_heads} KV heads x {head_dim} dim",
    )


def _mamba2_shapes(cfg: _Cfg) -> tuple[tuple[int, int], tuple[int, int, int]]:
    model_type = cfg.get("model_type")
    hidden = cfg.need_int("hidden_size")
    if model_type == "mamba2":
        inter = cfg.need_int("expand") * hidden
        groups, heads = cfg.need_int("n_groups"), cfg.need_int("num_heads")
        head_dim, state, kernel = (
            cfg.need_int("head_dim"),
            cfg.need_int("state_size"),
            cfg.need_int("conv_kernel"),
        )
    elif model_type == "nemotron_h":
        heads, head_dim = cfg.need_int("mamba_num_heads"), cfg.need_int("mamba_head_dim")
        inter = heads * head_dim
        groups, state, kernel = (
            cfg.need_int("n_groups"),
            cfg.need_int("ssm_state_size"),
            cfg.need_int("conv_kernel"),
        )
    elif model_type == "zamba2":
        inter = cfg.need_int("mamba_expand") * hidden
        groups, heads = cfg.need_int("mamba_ngroups"), cfg.need_int("n_mamba_heads")
        head_dim, state, kernel = (
            cfg.need_int("mamba_headdim"),
            cfg.need_int("mamba_d_state"),
            cfg.need_int("mamba_d_conv"),
        )
    else:  # GraniteMoeHybrid, FalconH1 and the like
        d_ssm = cfg.get("mamba_d_ssm")
        inter = int(d_ssm) if d_ssm is not None else int(cfg.need("mamba_expand") * hidden)
        groups, heads = cfg.need_int("mamba_n_groups"), cfg.need_int("mamba_n_heads")
        head_dim, state, kernel = (
            cfg.need_int("mamba_d_head"),
            cfg.need_int("mamba_d_state"),
            cfg.need_int("mamba_d_conv"),
        )
    conv_dim = inter + 2 * groups * state
    return (kernel - 1, conv_dim), (heads, head_dim, state)


def _mamba1_shapes(cfg: _Cfg) -> tuple[tuple[int, int], tuple[int, int]]:
    if cfg.get("model_type") == "jamba":
        inter = cfg.need_int("mamba_expand") * cfg.need_int("hidden_size")
        state, kernel = cfg.need_int("mamba_d_state"), cfg.need_int("mamba_d_conv")
    else:
        inter = cfg.need_int("intermediate_size")
        state, kernel = cfg.need_int("state_size"), cfg.need_int("conv_kernel")
    return (kernel - 1, inter), (inter, state)


def _gdn_shapes(cfg: _Cfg) -> tuple[tuple[int, int], tuple[int, int, int]]:
    k_heads, v_heads = cfg.need_int("linear_num_key_heads"), cfg.need_int("linear_num_value_heads")
    k_dim, v_dim = cfg.need_int("linear_key_head_dim"), cfg.need_int("linear_value_head_dim")
    kernel = cfg.need_int("linear_conv_kernel_dim")
    conv_dim = 2 * k_heads * k_dim + v_heads * v_dim
    return (kernel - 1, conv_dim), (v_heads, v_dim, k_dim)


def _numel(shape: tuple[int, ...]) -> int:
    total = 1
    for dim in shape:
        total *= dim
    return total


def _state_group(cfg: _Cfg, kind: str, count: int, conv_dtype: str, ssm_dtype: str) -> StateGroup:
    if kind == "mamba1":
        shapes: tuple[tuple[int, ...], ...] = _mamba1_shapes(cfg)
    elif kind == "mamba2":
        shapes = _mamba2_shapes(cfg)
    else:
        shapes = _gdn_shapes(cfg)
    dtypes = (conv_dtype, ssm_dtype)
    size = sum(_numel(s) * DTYPE_BYTES[d] for s, d in zip(shapes, dtypes, strict=True))
    return StateGroup(
        kind="gated_delta_net" if kind == "gdn" else kind,
        count=count,
        bytes_per_layer=size,
        shapes=shapes,
        dtypes=dtypes,
    )


def compute_kv_size(config: dict[str, Any], dtype: str = "auto", ssm_dtype: str = "auto") -> KVSize:
    """Size the caches of the model described by ``config`` (a parsed ``config.json``).

    ``dtype`` is the KV cache dtype ("auto" = the model's dtype, as vLLM's
    ``--kv-cache-dtype auto``); it also sets the conv-state dtype. ``ssm_dtype`` is the
    temporal (SSM) state dtype ("auto" = same as ``dtype``, as vLLM's
    ``--mamba-ssm-cache-dtype auto``).
    """
    cfg = _Cfg(config)
    kv_dtype = _model_dtype(cfg) if dtype == "auto" else normalize_dtype(dtype)
    state_dtype = kv_dtype if ssm_dtype == "auto" else normalize_dtype(ssm_dtype)
    kinds = _layer_kinds(cfg)

    attn_counts: Counter[str] = Counter()
    state_counts: Counter[str] = Counter()
    for kind in kinds:
        for part in kind.split("+"):
            if part in ("attn", "sliding"):
                attn_counts[part] += 1
            elif part in ("mamba1", "mamba2", "gdn"):
                state_counts[part] += 1

    dtype_bytes = DTYPE_BYTES[kv_dtype]
    attention = tuple(
        _attention_group(cfg, kind, attn_counts[kind], dtype_bytes)
        for kind in ("attn", "sliding")
        if attn_counts[kind]
    )
    states = tuple(
        _state_group(cfg, kind, state_counts[kind], kv_dtype, state_dtype)
        for kind in ("mamba1", "mamba2", "gdn")
        if state_counts[kind]
    )
    architectures = cfg.get("architectures") or [""]
    return KVSize(
        model_type=str(cfg.get("model_type", "")),
        architecture=str(architectures[0]),
        dtype=kv_dtype,
        num_layers=len(kinds),
        attention=attention,
        states=states,
    )


def human_bytes(n: float) -> str:
    """``n`` bytes in binary units (KiB, MiB, GiB) and, from a megabyte up, decimal too."""
    binary = ["B", "KiB", "MiB", "GiB", "TiB"]
    value, unit = float(n), 0
    while value >= 1024 and unit < len(binary) - 1:
        value /= 1024
        unit += 1
    text = f"{value:.1f} {binary[unit]}" if unit else f"{int(n)} B"
    if n >= 1e6:
        decimal = [(1e12, "TB"), (1e9, "GB"), (1e6, "MB")]
        scale, name = next((s, u) for s, u in decimal if n >= s)
        text += f" = {n / scale:.2f} {name}"
    return text


def format_report(size: KVSize, tokens: int, link_gbps: float | None) -> str:
    """The human-readable report ``vllm-pd kv-size`` prints."""
    lines = [
        f"model: {size.architecture or size.model_type} ({size.model_type}), "
        f"{size.num_layers} layers, KV dtype {size.dtype} ({size.dtype_bytes} B)",
    ]
    if size.attention:
        lines.append(
            f"attention KV per token: {size.bytes_per_token:,} B "
            f"({human_bytes(size.bytes_per_token)})"
        )
        for g in size.attention:
            window = f", window {g.window:,} tokens" if g.window is not None else ""
            lines.append(
                f"  {g.count} x {g.kind} ({g.detail}{window}): "
                f"{g.bytes_per_token_per_layer:,} B per token per layer"
            )
    else:
        lines.append("attention KV per token: 0 B (no attention layers)")
    if size.states:
        lines.append(
            f"recurrent state per sequence: {size.state_bytes_per_sequence:,} B "
            f"({human_bytes(size.state_bytes_per_sequence)})"
        )
        for s in size.states:
            shapes = " + ".join(
                f"{'x'.join(map(str, shape))} {dt}"
                for shape, dt in zip(s.shapes, s.dtypes, strict=True)
            )
            lines.append(f"  {s.count} x {s.kind} ({shapes}): {s.bytes_per_layer:,} B per layer")
    kv = size.kv_bytes_for(tokens)
    lines.append(f"prompt of {tokens:,} tokens: KV {kv:,} B ({human_bytes(kv)})")
    total = size.transfer_bytes_for(tokens)
    if size.states:
        lines.append(f"  with state, per P/D transfer: {total:,} B ({human_bytes(total)})")
    if link_gbps is not None:
        seconds = ideal_transfer_seconds(total, link_gbps)
        lines.append(
            f"ideal transfer at {link_gbps:g} Gb/s: {seconds * 1e3:,.1f} ms "
            f"(zero overhead; real links add setup and per-span costs)"
        )
    return "\n".join(lines)
