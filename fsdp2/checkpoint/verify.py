"""``python -m fsdp2.checkpoint.verify PATH...``: check checkpoints without a process group.

Each PATH is a checkpoint folder or a root of ``step-N`` folders. Prints one
line per folder (``ok`` or its problems) and exits with status 1 if any is
damaged.
"""

from __future__ import annotations

import argparse
import sys

from .integrity import verify_checkpoint


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m fsdp2.checkpoint.verify", description=__doc__)
    parser.add_argument("paths", nargs="+", help="checkpoint folders or roots of step-N folders")
    damaged = False
    for path in parser.parse_args(argv).paths:
        for folder, found in verify_checkpoint(path).items():
            damaged = damaged or bool(found)
            print(f"{folder}: " + ("ok" if not found else "DAMAGED\n  " + "\n  ".join(found)))
    return 1 if damaged else 0


if __name__ == "__main__":
    sys.exit(main())
