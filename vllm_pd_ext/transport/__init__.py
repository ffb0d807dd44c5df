"""Moving KV bytes between processes: a small protocol and backends (issue #5)."""
