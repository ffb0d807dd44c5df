"""P/D-aware OpenAI-compatible proxy: see README.md in this folder for the reading path."""
