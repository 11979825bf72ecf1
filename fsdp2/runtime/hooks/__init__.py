"""The hooks: forward and backward hooks of one ``fully_shard`` call, root lazy init and its checks."""
