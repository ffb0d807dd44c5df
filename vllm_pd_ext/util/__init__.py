"""Helpers every part may use: Prometheus text, config files, ``vllm serve`` processes and tiny
test models. Nothing here imports another part of the package, so any part can import it.

Named ``util`` rather than ``common``: ``connectors/common`` already names what the connectors
share.
"""
