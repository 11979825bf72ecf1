"""Meshes: the shard and replicate dims of a group, per-parameter meshes, SPMD meshes."""
