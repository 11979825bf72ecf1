"""pytest configuration: make the repo root and tests/ importable, report the impl.

Fixtures: ``launch_cases`` (module scope), named cases run in batched launches.
"""

from __future__ import annotations

import os
import sys

import pytest

_TESTS = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_TESTS)
for _p in (_ROOT, _TESTS):
    if _p not in sys.path:
        sys.path.insert(0, _p)


def pytest_report_header(config):
    from _impl import IMPL

    return f"FSDP2_TEST_IMPL={IMPL}"


@pytest.fixture(scope="module")
def launch_cases():
    """This module's batched launches of named cases (see ``checks.Launches``)."""
    from checks import Launches

    launches = Launches()
    yield launches
    launches.clear()
