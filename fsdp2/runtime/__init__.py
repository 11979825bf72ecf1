"""The per-step engine: hooks and lazy init, parameter groups, parameters and their
flat buffers, collectives, gradient reduction, meshes, mixed precision."""
