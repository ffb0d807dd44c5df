"""What the connectors share (block layout, handshake side channel, leases, stats)."""
