"""Operator tools: KV-size calculator, tiny test models, vllm serve process helper, P/D demo."""
