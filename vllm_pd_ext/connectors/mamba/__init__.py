"""PdExtMambaStateConnector: P/D for hybrid attention + SSM models."""
