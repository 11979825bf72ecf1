"""Every user mistake upstream's ``fully_shard`` raises on raises the same way in fsdp2.

A table of rows, one per user-reachable ``raise`` in upstream's
``torch/distributed/fsdp/_fully_shard/`` (plus the composable-API contract's
"applied twice"): each row makes the mistake and states upstream's class and
message. Both implementations must raise an instance of that class whose
message contains upstream's (fsdp2: starts with it, its own guidance after);
where upstream's class is ``AssertionError`` or ``NotImplementedError``,
fsdp2's exception is also a ``ValueError`` (see [Note: Exceptions compatible
with upstream] in fsdp2/errors.py). Every rank raises, at W = 2 and 4.

``raises_for(release)`` in ``upstream_raises.py`` lists every ``raise`` of the
package in each tested torch release (2.13, 2.15) with the row or test covering
it, or why no user can reach it; ``test_every_upstream_raise_is_accounted_for``
re-reads the installed upstream's source so a new torch release shows what is new. Rows for APIs fsdp2 does not have yet
(``dp_mesh_dims``, ``DataParallelMeshDims``, ``share_comm_ctx``, the 2.13
communication setters) skip for fsdp2 until those land and run for upstream.
"""

from __future__ import annotations

import ast
import os
from collections import Counter

import pytest
import torch
import torch.distributed.fsdp
import upstream_error_rows_213  # noqa: F401 - registers its rows
from _impl import IMPL
from checks import check_case
from upstream_error_rows import ROWS, Row, available
from upstream_raises import EXTRA_ROWS, raises_for

from fsdp2.versions import TORCH_RELEASE

# ---- the table ---------------------------------------------------------------------------


def _check_row(r: Row, rank: int, world_size: int) -> None:
    expect = r.build(rank, world_size)
    try:
        expect.thunk()
    except BaseException as e:  # noqa: BLE001 - the class is what is checked
        exc = e
    else:
        raise AssertionError(f"{r.name}: nothing raised; upstream raises {expect.cls.__name__}")
    message = expect.message() if callable(expect.message) else expect.message
    options = message if isinstance(message, tuple) else (message,)
    text = str(exc)
    where = f"{r.name} on rank {rank}: {type(exc).__name__}: {text}"
    assert isinstance(exc, expect.cls), f"{where}\nis not a {expect.cls.__name__}"
    assert any(m in text for m in options), f"{where}\ndoes not contain upstream's {options}"
    if expect.exact:
        assert text in options, f"{where}\nis not exactly upstream's {options}"
    if IMPL == "fsdp2":
        assert any(text.startswith(m) for m in options), f"{where}\ndoes not start with {options}"
        if expect.cls in (AssertionError, NotImplementedError):
            assert isinstance(exc, ValueError), f"{where}\nis not also a ValueError"


def _cases(world_size: int) -> dict:
    return {
        name: (lambda rank, ws, r=r: _check_row(r, rank, ws))
        for name, r in ROWS.items()
        if world_size >= r.min_world and available(r.needs)
    }


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("name", sorted(ROWS))
def test_upstream_error(name, world_size, launch_cases):
    """Row ``name``: upstream's class and message, on every rank (one launch per world size)."""
    r = ROWS[name]
    if world_size < r.min_world:
        pytest.skip(f"needs a shard group of {r.min_world} ranks")
    if not available(r.needs):
        pytest.skip(f"{IMPL} has no {r.needs} yet (issue 14, point 8)")
    check_case(launch_cases(world_size, _cases(world_size)), name)


# ---- every upstream raise is accounted for ----------------------------------------------


def _raises_in(node: ast.AST, file: str, scope: tuple[str, ...], sites: list) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            _raises_in(child, file, (*scope, child.name), sites)
            continue
        if isinstance(child, ast.Raise):
            exc = child.exc.func if isinstance(child.exc, ast.Call) else child.exc
            sites.append((file, ".".join(scope), getattr(exc, "id", "?")))
        _raises_in(child, file, scope, sites)


def _upstream_raise_sites() -> list[tuple[str, str, str]]:
    """(file, enclosing function, class) of every ``raise`` in upstream's package source."""
    package = os.path.join(os.path.dirname(torch.distributed.fsdp.__file__), "_fully_shard")
    sites: list[tuple[str, str, str]] = []
    for file in sorted(os.listdir(package)):
        if file.endswith(".py"):
            with open(os.path.join(package, file)) as f:
                _raises_in(ast.parse(f.read()), file, (), sites)
    return sites


def test_every_upstream_raise_is_accounted_for():
    """Each raise of upstream's package is listed with a row or a reason; every row is listed."""
    listed_raises = raises_for(TORCH_RELEASE)
    if listed_raises is None:
        pytest.skip(f"upstream_raises.py does not describe torch {torch.__version__} yet")
    for r in listed_raises:
        if ":" in r.covered_by:
            reason = r.covered_by.split(":", 1)[0]
            assert reason in ("internal", "private", "accelerator", "ranks", "tested", "unsupported"), r
        else:
            missing = [name for name in r.covered_by.split() if name not in ROWS]
            assert not missing, (r, missing)
    covered = {n for r in listed_raises if ":" not in r.covered_by for n in r.covered_by.split()}
    assert covered | set(EXTRA_ROWS) == set(ROWS), set(ROWS) ^ (covered | set(EXTRA_ROWS))
    found = Counter(_upstream_raise_sites())
    listed = Counter((r.file, r.function, r.cls) for r in listed_raises)
    assert found == listed, f"new in torch: {found - listed}\nno longer in torch: {listed - found}"
