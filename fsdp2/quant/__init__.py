"""Quantized communication on sharded models: block-scaled fp8 all-gathers (fp8_tiles.py)."""

from .fp8_tiles import dequantize_tiles, gather_fp8_tiles, quantize_tiles

__all__ = ["dequantize_tiles", "gather_fp8_tiles", "quantize_tiles"]
