"""``python -m fsdp2.plan``: see ``fsdp2/plan/cli.py``."""

from fsdp2.plan.cli import main

if __name__ == "__main__":
    main()
