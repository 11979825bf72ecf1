"""FSDP1 tools on top of fully_shard: summon_full_params, shard_model with wrap policies."""
