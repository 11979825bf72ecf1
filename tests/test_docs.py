"""The repository's documentation stands on its own: links resolve inside the repository.

A user's clone has only what is committed, so every relative link in a
markdown file must name a file of the repository (and a heading of it, when
the link has an anchor), and no file may point at the folder of notes that
lives beside the repository on the maintainers' machines.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

pytestmark = pytest.mark.torch_independent  # the same on every torch: CI runs it once

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Built from parts so that this file does not contain the string it looks for.
OUTSIDE_NOTES = "/".join(["..", "shared"])

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto:, ...


def _repo_files() -> list[str]:
    """Tracked and untracked-but-not-ignored files, relative to the root."""
    try:
        out = subprocess.run(
            ["git", "-C", ROOT, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            check=True, capture_output=True,
        ).stdout.decode()
        return sorted({f for f in out.split("\0") if f and os.path.isfile(os.path.join(ROOT, f))})
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (e.g. an sdist)
        skip = {".git", ".venv", "venv", "build", "dist", "__pycache__", ".pytest_cache",
                ".ruff_cache", "out"}
        files = []
        for folder, dirs, names in os.walk(ROOT):
            dirs[:] = [d for d in dirs if d not in skip and not d.endswith(".egg-info")]
            files += [os.path.relpath(os.path.join(folder, n), ROOT) for n in names]
        return sorted(files)


def _markdown_files() -> list[str]:
    return [f for f in _repo_files() if f.endswith(".md")]


def _read(relpath: str) -> str:
    with open(os.path.join(ROOT, relpath), encoding="utf-8", errors="replace") as f:
        return f.read()


def _links(markdown: str) -> list[str]:
    """Link and image targets outside code blocks and code spans."""
    prose = _CODE_SPAN.sub("", _FENCE.sub("", markdown))
    return _LINK.findall(prose)


def _anchors(markdown: str) -> set[str]:
    """GitHub's anchors for the headings of a markdown file."""
    anchors = set()
    for line in _FENCE.sub("", markdown).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            title = re.sub(r"[^\w\- ]", "", match.group(1).lower())
            anchors.add(title.replace(" ", "-"))
    return anchors


def _problems(relpath: str, markdown: str | None = None) -> list[str]:
    """What is wrong with the relative links of ``relpath`` (or of ``markdown`` placed there)."""
    problems = []
    for target in _links(_read(relpath) if markdown is None else markdown):
        if _EXTERNAL.match(target):
            continue
        path, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(ROOT, os.path.dirname(relpath), path))
        if os.path.relpath(resolved, ROOT).startswith(".."):
            problems.append(f"{relpath}: {target} leaves the repository")
        elif not os.path.exists(resolved):
            problems.append(f"{relpath}: {target} does not exist")
        elif anchor and resolved.endswith(".md") and anchor not in _anchors(_read(resolved)):
            problems.append(f"{relpath}: {target} names no heading of {os.path.basename(resolved)}")
    return problems


def test_relative_markdown_links_resolve():
    """Every relative link and image in the repository's markdown names an existing file and heading."""
    files = _markdown_files()
    assert {"README.md", "CONTRIBUTING.md", "docs/design.md", "docs/style.md"} <= set(files)
    problems = [p for f in files for p in _problems(f)]
    assert not problems, "\n".join(problems)


def test_readme_and_contributing_link_the_docs():
    """README.md and CONTRIBUTING.md link docs/design.md and docs/style.md."""
    for relpath in ("README.md", "CONTRIBUTING.md"):
        links = {target.partition("#")[0] for target in _links(_read(relpath))}
        assert {"docs/design.md", "docs/style.md"} <= links, (relpath, sorted(links))


def test_no_file_points_outside_the_repository():
    """No file of the repository mentions the maintainers' notes folder beside it."""
    offenders = []
    for relpath in _repo_files():
        try:
            text = _read(relpath)
        except OSError:
            continue
        offenders += [
            f"{relpath}:{n}" for n, line in enumerate(text.splitlines(), 1) if OUTSIDE_NOTES in line
        ]
    assert not offenders, offenders


def test_link_checker_catches_broken_links():
    """The checker reports a missing file, a missing heading and a link out of the tree, nothing else."""
    markdown = (
        "[ok](README.md) [gone](docs/nope.md) [bad](README.md#no-such-heading) "
        "[head](README.md#two-commands) [pic](benchmarks/results.png) "
        f"[out]({OUTSIDE_NOTES}/X.md) `[code](ignored.md)` [web](https://example.com)\n"
        "```\n[fenced](ignored.md)\n```\n"
    )
    problems = _problems("README.md", markdown)
    assert len(problems) == 3, problems
    assert "docs/nope.md does not exist" in problems[0]
    assert "#no-such-heading names no heading" in problems[1]
    assert "leaves the repository" in problems[2]
