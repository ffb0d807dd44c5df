"""The test-time model builders: real tokenizers, chat templates, loadable configs."""

from __future__ import annotations

import json

import pytest

from tests.conftest import requires_model_deps

pytestmark = requires_model_deps


@pytest.fixture(scope="module")
def qwen_tok(tiny_qwen):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen)


@pytest.fixture(scope="module")
def llama_tok(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


def test_qwen_vocabulary_is_qwen25s(qwen_tok):
    # Ids Qwen2/2.5's published tokenizer gives; special tokens sit at their real ids.
    assert qwen_tok.encode("Hello world") == [9707, 1879]
    assert qwen_tok.convert_tokens_to_ids(
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
    ) == [151643, 151644, 151645, 151657, 151658]
    text = "naïve café, 你好, emoji 🙂 and code: x += 1"
    assert qwen_tok.decode(qwen_tok.encode(text)) == text


def test_qwen_chatml_template_with_tools(qwen_tok):
    messages = [{"role": "user", "content": "weather in Paris?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    text = qwen_tok.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\n")
    assert '"name": "get_weather"' in text
    assert text.endswith("<|im_start|>user\nweather in Paris?<|im_end|>\n<|im_start|>assistant\n")


def test_llama_tokenizer_and_template(llama_tok, tiny_llama):
    ids = llama_tok.encode("def main():\n    return 0\n")
    assert ids[0] == llama_tok.bos_token_id
    assert llama_tok.decode(ids, skip_special_tokens=True) == "def main():\n    return 0\n"
    text = llama_tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    config = json.loads((tiny_llama / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["vocab_size"] == len(llama_tok)


def test_models_are_cached_and_reproducible(model_cache, tiny_llama, tmp_path):
    from vllm_pd_ext.util.tiny_model import ensure_model

    assert ensure_model("tiny-llama", model_cache) == tiny_llama  # cached, not rebuilt
    again = ensure_model("tiny-llama", tmp_path)
    for name in ("model.safetensors", "tokenizer.json"):
        assert (again / name).read_bytes() == (tiny_llama / name).read_bytes()
    with pytest.raises(ValueError, match="unknown model"):
        ensure_model("gpt-5", tmp_path)
