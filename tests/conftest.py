"""pytest configuration: make the repo root and tests/ importable, report the impl."""

from __future__ import annotations

import os
import sys

_TESTS = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_TESTS)
for _p in (_ROOT, _TESTS):
    if _p not in sys.path:
        sys.path.insert(0, _p)


def pytest_report_header(config):
    from _impl import IMPL

    return f"FSDP2_TEST_IMPL={IMPL}"
