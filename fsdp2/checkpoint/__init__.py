"""State dicts and checkpoints: rank-0 full state dicts, DCP checkpoints (atomic, async,
keep-last-k), optimizer state keyed by index."""
