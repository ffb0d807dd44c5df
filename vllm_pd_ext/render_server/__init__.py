"""Standalone render / derender server (issue #4)."""
