"""The checksum a checkpoint's manifest records: CRC-32C in hardware, or zlib's CRC-32.

[Note: Checksum algorithms]
Summing every byte a save writes sits inside the save's stall, and on a
machine whose cores the write already uses it cannot be hidden. zlib's
CRC-32 runs at 1.7-3.6 GB/s here, page-cache writes at 0.35-1 GB/s, so it
cost 10-25% of the write. CRC-32C (the Castagnoli polynomial: iSCSI, ext4,
Btrfs, GCS) has an instruction of its own on x86 (SSE 4.2) and ARM (CRC32
extension); the ``crc32c`` package uses it at 14 GB/s here, and its
error-detection is at least CRC-32's (every burst up to 32 bits, any other
damage with probability 1 - 2^-32). So a save records CRC-32C where that
package has the instruction and zlib's CRC-32 elsewhere; the manifest names
the algorithm, and a load checks each manifest with the algorithm it names
(those written before this choice say ``crc32``).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

__all__ = ["DEFAULT", "LABELS", "extender"]

LABELS = {"crc32": "CRC-32", "crc32c": "CRC-32C"}


def _hardware_crc32c() -> Any:
    """The ``crc32c`` module where it computes in hardware, else ``None``."""
    try:
        import crc32c
    except ImportError:
        return None
    return crc32c if getattr(crc32c, "hardware_based", False) else None


_CRC32C = _hardware_crc32c()
DEFAULT = "crc32c" if _CRC32C is not None else "crc32"  # what a save records


def extender(algorithm: str) -> Callable[[Any, int], int]:
    """``f(data, crc) -> crc`` extending a running checksum by ``data`` (any buffer)."""
    if algorithm == "crc32":
        return zlib.crc32
    if algorithm == "crc32c":
        module = _CRC32C
        if module is None:
            try:  # a manifest written elsewhere: the package's software path is still right
                import crc32c as module
            except ImportError as exc:
                raise ImportError(
                    "this checkpoint's manifest records CRC-32C checksums, which need the "
                    "'crc32c' package (a dependency of fsdp2): pip install crc32c"
                ) from exc
        return module.crc32c
    raise ValueError(f"unknown checksum algorithm {algorithm!r} (known: {sorted(LABELS)})")
