"""fsdp2's packages import only downward, in the order ``docs/design.md`` declares.

Every import in the package counts: at module level, inside functions and
under ``TYPE_CHECKING``. A module may import modules of its own unit (a
package such as ``runtime/``, or a single top-level module) and of units in
lower layers, never a unit beside it or above it. ``test_planted_upward_import``
shows the walk catches an edge as soon as one appears.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.torch_independent  # the same on every torch: CI runs it once

PACKAGE = Path(__file__).resolve().parent.parent / "fsdp2"

# Top to bottom; a unit is a subpackage or a top-level module of fsdp2.
LAYERS: list[tuple[str, ...]] = [
    ("__init__", "pipelining"),  # the public surface: re-exports only
    ("plan",),  # the planner drives the library as a user would
    ("checkpoint", "optim", "fsdp1", "integrations", "quant"),  # tools on the public surface
    ("upstream_names",),  # upstream's private names on the wrapping's and engine's objects
    ("fully_shard",),
    ("module_functions",),  # register_fsdp_forward_method, share_comm_ctx
    ("module",),  # FSDPModule, the control surface
    ("handles",),
    ("runtime",),  # the engine's package docstring
    ("runtime.hooks",),  # the per-step engine, top down: hooks and lazy init,
    ("runtime.group",),  # a group and its reduction,
    ("runtime.comm",),  # collectives and streams,
    ("runtime.storage",),  # a parameter and its flat buffer,
    ("runtime.meshes",),  # meshes,
    ("runtime.common",),  # casts, tensor trees, profiler ranges
    ("api",),  # policies and plain values
    ("ragged_placement",),  # the parameter-major layout's placement, below the values using it
    ("errors", "versions", "_torch_compat", "agree", "claim_file", "file_tensors"),  # leaves
    ("identity_cache",),  # below the leaves: _torch_compat keeps a cache by identity
]
RANK = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _unit(module: str) -> str:
    """``fsdp2.x.y`` -> ``x``; the engine's subpackages are units of their own (``runtime.hooks``)."""
    parts = module.split(".")
    if len(parts) > 2 and parts[1] == "runtime":
        return f"runtime.{parts[2]}"
    return parts[1] if len(parts) > 1 else "__init__"


def _imported(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """``(line, fsdp2 module)`` for every import of fsdp2 code, wherever it is written."""
    found = []
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "fsdp2"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "fsdp2":
                continue
            if target == "fsdp2" or not node.module:  # `from . import x`: x is a module
                found += [(node.lineno, f"{target}.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, target))
    return found


def layer_violations(sources: dict[Path, str]) -> list[str]:
    problems = []
    for path, source in sorted(sources.items()):
        module = _module_name(path)
        src_unit = _unit(module)
        assert src_unit in RANK, f"{path}: unit {src_unit!r} is in no layer; add it to LAYERS"
        for line, target in _imported(ast.parse(source), module, path.name == "__init__.py"):
            dst_unit = _unit(target)
            if dst_unit not in RANK:  # `from fsdp2 import name`: the public surface
                dst_unit = "__init__"
            if dst_unit == src_unit or RANK[dst_unit] > RANK[src_unit]:
                continue
            problems.append(
                f"{path.relative_to(PACKAGE.parent)}:{line} imports {target} "
                f"({dst_unit!r} is not below {src_unit!r})"
            )
    return problems


def _package_sources() -> dict[Path, str]:
    return {p: p.read_text() for p in PACKAGE.rglob("*.py")}


def test_imports_only_point_down() -> None:
    assert layer_violations(_package_sources()) == []


def test_every_unit_is_in_a_layer() -> None:
    units = {_unit(_module_name(p)) for p in PACKAGE.rglob("*.py")}
    assert units == set(RANK), f"not in LAYERS: {units - set(RANK)}; gone: {set(RANK) - units}"


def test_planted_upward_import() -> None:
    sources = _package_sources()
    hooks = PACKAGE / "runtime" / "hooks" / "state.py"
    storage = PACKAGE / "runtime" / "storage" / "param.py"
    planted = dict(sources)
    # inside a function and under TYPE_CHECKING count as much as a top-level import
    planted[hooks] = sources[hooks] + "\n\ndef _late():\n    from ...optim import clip_grad\n"
    planted[PACKAGE / "api.py"] = sources[PACKAGE / "api.py"] + (
        "\nif TYPE_CHECKING:\n    from .module import FSDPModule\n"
    )
    # inside the engine, storage may not reach up to the group
    planted[storage] = sources[storage] + "\n\ndef _late():\n    from ..group import param_group\n"
    problems = layer_violations(planted)
    assert len(problems) == 3, problems
    assert "fsdp2/api.py" in problems[0] and "fsdp2.module" in problems[0]
    assert "fsdp2/runtime/hooks/state.py" in problems[1] and "imports fsdp2.optim" in problems[1]
    assert "fsdp2/runtime/storage/param.py" in problems[2]
    assert "'runtime.group' is not below 'runtime.storage'" in problems[2]


def import_cycles(sources: dict[Path, str], unit: str) -> list[list[str]]:
    """The import cycles among ``unit``'s modules (``TYPE_CHECKING`` imports count), each sorted."""
    modules = {_module_name(p): (p, s) for p, s in sources.items() if _unit(_module_name(p)) == unit}
    graph: dict[str, set[str]] = {}
    for name, (path, source) in modules.items():
        targets = set()
        for _, target in _imported(ast.parse(source), name, path.name == "__init__.py"):
            while target and target not in modules:  # `from .m import name` -> m
                target = target.rpartition(".")[0]
            if target and target != name and modules[target][0].name != "__init__.py":
                targets.add(target)
        graph[name] = targets

    def reaches(start: str) -> set[str]:
        seen, todo = set(), list(graph[start])
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo += graph[m]
        return seen

    reach = {m: reaches(m) for m in graph}
    cycles = {tuple(sorted(m2 for m2 in reach[m] if m in reach[m2])) for m in graph if m in reach[m]}
    return sorted(list(c) for c in cycles)


def test_storage_modules_import_one_way() -> None:
    """Inside the storage layer too: ``param`` -> ``ragged_rows``, ``buffer_order`` and ``ragged``
    -> ``param``, never back (issue 61: ``ragged`` once imported ``param``, which imported it)."""
    sources = _package_sources()
    assert import_cycles(sources, "runtime.storage") == []
    param = PACKAGE / "runtime" / "storage" / "param.py"
    planted = dict(sources)
    planted[param] = sources[param] + "\n\ndef _late():\n    from .ragged import ParamMajor\n"
    assert import_cycles(planted, "runtime.storage") == [
        ["fsdp2.runtime.storage.buffer_order", "fsdp2.runtime.storage.param",
         "fsdp2.runtime.storage.ragged"]  # ragged -> buffer_order -> param -> ragged
    ]


# The optimizer step's modules, top to bottom (issue 60's "house of the step"): the entry
# points (the explicit one above the default), the engine (plans, hands the cuts to a strategy), the two strategies, what a
# strategy steps (replica slices, units), the cut itself, the flat runs, then where state
# lives and how it is published. A module imports only modules below it.
STEP_ORDER: list[tuple[str, ...]] = [
    ("local_shard_step",),  # enable_local_shard_step replaces the default step
    ("default_step",),
    ("step_engine",),
    ("memory_step", "store_step"),
    ("replica_sharded_step", "unit_step"),
    ("step_plan",),
    ("flat_run",),
    ("state_views", "state_store"),
]


def step_order_violations(sources: dict[Path, str]) -> list[str]:
    """Imports among the step's modules that do not point down ``STEP_ORDER``."""
    rank = {f"fsdp2.optim.{m}": i for i, level in enumerate(STEP_ORDER) for m in level}
    problems = []
    for path, source in sorted(sources.items()):
        module = _module_name(path)
        if module not in rank:
            continue
        for line, target in _imported(ast.parse(source), module, False):
            while target and target not in rank and target.count(".") > 2:
                target = target.rpartition(".")[0]  # `from .m import name` -> m
            if target in rank and rank[target] <= rank[module]:
                problems.append(f"{path.name}:{line} imports {target}")
    return problems


def test_the_step_imports_one_way() -> None:
    """engine -> strategy -> slices/units -> plan -> runs -> storage and publishing, never back;
    a planted import of the engine from a strategy is caught."""
    sources = _package_sources()
    optim = {_module_name(p) for p in sources if _unit(_module_name(p)) == "optim"}
    for level in STEP_ORDER:
        for m in level:
            assert f"fsdp2.optim.{m}" in optim, f"STEP_ORDER names {m}, which is gone"
    assert step_order_violations(sources) == []
    planted = dict(sources)
    store = PACKAGE / "optim" / "store_step.py"
    planted[store] = sources[store] + "\n\ndef _late():\n    from .step_engine import StepEngine\n"
    plan = PACKAGE / "optim" / "step_plan.py"
    planted[plan] = sources[plan] + "\nif TYPE_CHECKING:\n    from .unit_step import keep\n"
    problems = step_order_violations(planted)
    assert len(problems) == 2 and "imports fsdp2.optim.unit_step" in problems[0], problems
    assert "store_step.py" in problems[1] and "fsdp2.optim.step_engine" in problems[1], problems


def test_layers_match_design_doc() -> None:
    design = (PACKAGE.parent / "docs" / "design.md").read_text()
    for layer in LAYERS:
        for unit in layer:
            if unit != "__init__":
                assert f"`{unit}" in design, f"docs/design.md does not place {unit!r}"


def _module_table(design: str) -> list[str]:
    """The first cell of each row of design.md's module table ("| module | holds | why ...")."""
    lines = design.split("## The modules", 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| module |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(line.split("|")[1])
    return rows


def _modules_named(cell: str) -> set[str]:
    """``a/b.py`` paths named in a table cell (each between backticks)."""
    return {name for name in re.findall(r"`([\w/]+\.py)`", cell)}


def map_problems(design: str, modules: set[str]) -> list[str]:
    """What design.md's module table and the package's modules disagree on."""
    rows = _module_table(design)
    named = set().union(*(_modules_named(cell) for cell in rows))
    problems = [f"{m}: a module with no row in docs/design.md" for m in sorted(modules - named)]
    problems += [f"{m}: a row of docs/design.md naming no module" for m in sorted(named - modules)]
    problems += [f"row {cell.strip()!r} names no module" for cell in rows if not _modules_named(cell)]
    return problems


def _package_modules() -> set[str]:
    return {
        p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
        if p.name not in ("__init__.py", "__main__.py") or p.parent == PACKAGE
    }


def test_every_module_has_a_row_in_design_doc() -> None:
    """Every module of the package is named in design.md's module table, and every name is one."""
    design = (PACKAGE.parent / "docs" / "design.md").read_text()
    assert map_problems(design, _package_modules()) == []


def test_module_map_catches_planted_mistakes() -> None:
    design = (PACKAGE.parent / "docs" / "design.md").read_text()
    modules = _package_modules() | {"runtime/storage/new_thing.py"}  # a module nobody mapped
    row = next(r for r in design.splitlines() if r.startswith("| `agree.py`"))
    planted = design.replace(row, row.replace("`agree.py`", "`agreement.py`"))  # a stale row
    assert map_problems(planted, modules) == [
        "agree.py: a module with no row in docs/design.md",
        "runtime/storage/new_thing.py: a module with no row in docs/design.md",
        "agreement.py: a row of docs/design.md naming no module",
    ]
