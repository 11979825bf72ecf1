"""Other parts of torch driving fsdp2: patch_torch, pipeline stages."""
