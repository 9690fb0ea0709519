"""Parts every op family shares: per-stream scratch, the host op-call mechanism, the persistent tile scheduler."""
