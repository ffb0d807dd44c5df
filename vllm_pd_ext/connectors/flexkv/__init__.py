"""PdExtFlexKVConnector: tiered KV cache (device, CPU memory, SSD) with prefix reuse."""
