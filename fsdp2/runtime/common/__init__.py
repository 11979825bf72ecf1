"""What every layer of the engine reads: mixed-precision casts, tensor trees, profiler ranges."""
