"""The version says what it is: ``fsdp2.__version__``, pyproject and the changelog agree."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import fsdp2

pytestmark = pytest.mark.torch_independent  # the same on every torch: CI runs it once

ROOT = Path(__file__).resolve().parent.parent


def test_version_matches_pyproject_and_changelog() -> None:
    pyproject = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert pyproject is not None and pyproject.group(1) == fsdp2.__version__
    changelog = (ROOT / "CHANGELOG.md").read_text()
    releases = re.findall(r"^## \[(\d[^\]]*)\] - \d{4}-\d{2}-\d{2}$", changelog, re.M)
    assert releases and releases[0] == fsdp2.__version__, releases
    assert "## [Unreleased]" in changelog
