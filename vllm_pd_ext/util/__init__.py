"""Helpers every part may use: Prometheus text, config files, ``vllm serve`` processes, tiny
test models, token ids from a ``tokenizers`` backend, waiting with a time limit, log
throttling, admitting a listener's connections.
Nothing here imports another part of the package, so any part can import it.

Named ``util`` rather than ``common``: ``connectors/common`` already names what the connectors
share.
"""
