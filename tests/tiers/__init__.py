"""The offload tiers: shards, gradients and optimizer state at home on the host or on disk."""
