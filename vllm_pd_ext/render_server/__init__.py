"""Standalone render / derender server.

OpenAI requests in, token ids out (render); engine token ids in, OpenAI responses out (derender).
Wire-compatible with ``vllm launch render`` and runs without vLLM installed. Public entry points:
:func:`vllm_pd_ext.render_server.app.create_app` and :mod:`vllm_pd_ext.render_server.cli`.
"""
