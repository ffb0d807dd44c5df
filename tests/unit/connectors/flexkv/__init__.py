"""PdExtFlexKVConnector unit tests."""
