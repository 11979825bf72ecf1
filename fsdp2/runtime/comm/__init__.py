"""Collectives and streams: batched all-gather / reduce-scatter, their buffers, the comm context."""
