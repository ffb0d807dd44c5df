"""PdExtMoRIIOConnector: prefill-to-decode KV transfer (MoRI-IO on ROCm, Mooncake elsewhere)."""
