"""vllm-pd-ext: disaggregated prefill/decode serving for stock vLLM.

Users reach the KV connectors by name through vLLM's plugin system (see ``plugin.py``);
the render server, proxy and tools are started with the ``vllm-pd`` command.
"""

__version__ = "0.1.0.dev0"
