"""Operator commands: ``vllm-pd up`` (launcher), ``demo``, ``doctor``, ``bench``, ``kv-size``."""
