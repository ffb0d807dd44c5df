"""KV connectors, one subpackage each; vLLM reaches them by name (see ``plugin.py``)."""
