"""Storage: a sharded parameter, its group's flat buffer, the shard layout, the all-gather extensions."""
