"""Fixtures the integration modules share."""

from __future__ import annotations

import httpx
import pytest


@pytest.fixture(scope="module")
def client():
    """One pooled HTTP client per module, with a timeout long enough for CPU engines."""
    with httpx.Client(timeout=120.0) as c:
        yield c
