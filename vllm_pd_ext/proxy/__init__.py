"""P/D-aware OpenAI-compatible proxy (issue #3)."""
