"""Connector tests need vLLM (the real Scheduler) and, for transfers, Mooncake's engine."""

from __future__ import annotations

from tests.skips import need, requires

# Every module below imports vLLM: without it this folder is skipped (failed under CI).
need("vllm", why="connector tests drive its Scheduler", allow_module_level=True)

from vllm_pd_ext import plugin  # noqa: E402

plugin.register()

requires_mooncake = requires("mooncake", why="mooncake-transfer-engine(-non-cuda) moves the KV")
