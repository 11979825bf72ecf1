"""A parameter group: unshard, reshard, its gradient reduction and replica slices, its settings."""
