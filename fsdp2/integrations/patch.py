"""patch_torch(): route code written for ``torch.distributed.fsdp.fully_shard`` to fsdp2.

Libraries such as accelerate, torchtune and torchtitan call upstream's FSDP2
API by name. ``patch_torch()`` rebinds those public names, in the torch
modules that export them, to fsdp2's objects, so such code runs on fsdp2
without being edited; the returned :class:`TorchPatch` puts torch's objects
back.

Only public module attributes are reassigned (``setattr`` on a module, for
names the module already binds); no function, class or private field of
torch is modified, and upstream's own implementation modules are left alone,
so upstream ``fully_shard`` keeps working for anyone holding a reference to it.
"""

from __future__ import annotations

import importlib
import sys
import threading
import warnings
from types import ModuleType, TracebackType

__all__ = ["PATCHED_MODULES", "PATCHED_NAMES", "TorchPatch", "patch_torch"]

#: The public names of upstream's FSDP2 API that fsdp2 provides.
PATCHED_NAMES: tuple[str, ...] = (
    "fully_shard",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "UnshardHandle",
    "register_fsdp_forward_method",
    "DataParallelMeshDims",
    "share_comm_ctx",
    "GradientReductionHandle",
)

#: The modules user code imports those names from. ``torch.distributed.fsdp``
#: is the public home; ``torch.distributed._composable.fsdp`` and its
#: ``fully_shard`` submodule are the older import paths (torchtune uses them).
#: Deliberately not here: ``torch.distributed.fsdp._fully_shard`` and its
#: submodules, upstream's private implementation, which torch itself reads
#: (e.g. ``torch._dynamo`` assumes ``_fully_shard.FSDPModule`` is upstream's).
PATCHED_MODULES: tuple[str, ...] = (
    "torch.distributed.fsdp",
    "torch.distributed._composable.fsdp",
    "torch.distributed._composable.fsdp.fully_shard",
)

_lock = threading.Lock()
# (module, name) -> torch's object, saved by the first active patch.
_originals: dict[tuple[ModuleType, str], object] = {}
# How many handles are active; torch's objects come back when it drops to 0.
_active = 0


def _replacements() -> dict[str, object]:
    from .. import api, handles, module, module_functions
    from ..fully_shard import fully_shard

    homes = (module, module_functions, api, handles)
    found = {name: getattr(m, name) for m in homes for name in PATCHED_NAMES if hasattr(m, name)}
    return {"fully_shard": fully_shard, **found}


#: torch's pipelining modules, which bind ``FSDPModule`` and ``fully_shard`` at import:
#: patched too (when already imported; imported later, they bind the patched names
#: themselves), so torch's own ``PipelineStage`` and schedules treat fsdp2's modules as
#: upstream's. From torch 2.15 they drive FSDP stages through public methods only;
#: before, they also read upstream's private state through ``fully_shard.state(module)``,
#: which fsdp2's state answers under upstream's names (``FSDPState._state_ctx`` ...).
PIPELINING_MODULES: tuple[str, ...] = (
    "torch.distributed.pipelining.stage",
    "torch.distributed.pipelining.schedules",
)


def _modules() -> list[ModuleType]:
    modules = []
    for name in PATCHED_MODULES:
        try:
            modules.append(importlib.import_module(name))
        except ImportError:  # an older or newer torch without this alias
            continue
    modules.extend(sys.modules[name] for name in PIPELINING_MODULES if name in sys.modules)
    return modules


def _apply() -> None:
    ours = _replacements()
    # Import every module before patching any: the legacy alias copies the
    # names from torch.distributed.fsdp when first imported, and must copy torch's.
    modules = _modules()
    for module in modules:
        for name, obj in ours.items():
            if name in vars(module):  # only names the module binds; add none
                _originals[(module, name)] = vars(module)[name]
                setattr(module, name, obj)


def _restore() -> None:
    ours = _replacements()
    for (module, name), original in _originals.items():
        current = vars(module).get(name)
        if current is not ours[name]:
            warnings.warn(
                f"fsdp2.patch_torch: {module.__name__}.{name} was reassigned by other code "
                f"while patched ({current!r}); restoring torch's original anyway",
                RuntimeWarning,
                stacklevel=3,
            )
        setattr(module, name, original)
    _originals.clear()


class TorchPatch:
    """An active :func:`patch_torch`; ``undo()`` it, or use it as a context manager.

    Every handle is undone independently and at most once: undoing a handle
    twice does nothing the second time. torch's objects come back when the
    last active handle is undone.
    """

    def __init__(self) -> None:
        self._active = True

    @property
    def active(self) -> bool:
        """Whether this handle still holds the patch (``undo()`` not called yet)."""
        return self._active

    def undo(self) -> None:
        """Release this handle; restore torch's objects if no other handle is active."""
        global _active
        with _lock:
            if not self._active:
                return
            self._active = False
            _active -= 1
            if _active == 0:
                _restore()

    def __enter__(self) -> TorchPatch:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.undo()

    def __repr__(self) -> str:
        return f"<fsdp2.TorchPatch {'active' if self._active else 'undone'}>"


def patch_torch() -> TorchPatch:
    """Make torch's FSDP2 names refer to fsdp2's, until the returned handle is undone.

    Rebinds ``fully_shard``, ``FSDPModule``, ``MixedPrecisionPolicy``,
    ``OffloadPolicy``, ``CPUOffloadPolicy``, ``UnshardHandle``,
    ``register_fsdp_forward_method``, ``DataParallelMeshDims``,
    ``share_comm_ctx`` and ``GradientReductionHandle`` in
    ``torch.distributed.fsdp``, in the legacy
    ``torch.distributed._composable.fsdp`` and in its ``fully_shard``
    submodule (in each, only the names it binds), to fsdp2's objects; also in
    ``torch.distributed.pipelining``'s ``stage`` and ``schedules`` modules, so
    torch's own ``PipelineStage`` drives fsdp2 stages as it drives upstream's
    (before torch 2.15 it reads upstream's private state through
    ``fully_shard.state(module)``; fsdp2's state answers those names). FSDP1's
    classes keep torch's objects.

    While patched, ``isinstance(m, torch.distributed.fsdp.FSDPModule)`` holds
    for modules sharded by fsdp2 (the name is fsdp2's class), as code like
    accelerate and torch's pipelining expects; it does not hold for modules
    sharded by upstream's ``fully_shard``. Upstream's policy and
    ``DataParallelMeshDims`` objects created before the patch are still
    accepted by fsdp2's ``fully_shard``.

    **Import order.** Call it before importing any library that binds the
    names at import time (``from torch.distributed.fsdp import fully_shard`` at
    module level, e.g. torchtune, torchtitan, ``torch.distributed.pipelining``):
    such a module keeps whatever object the name had when it was imported.
    Code that looks the name up when it runs (``torch.distributed.fsdp.fully_shard(...)``,
    or a ``from ... import`` inside a function, as accelerate does) works
    either way.

    **Nesting.** Each call returns a new :class:`TorchPatch`. The first call
    saves torch's objects and patches; later calls while patched change
    nothing and never save fsdp2's objects as "originals". torch's exact
    objects are restored when every handle has been undone, so nested
    ``with fsdp2.patch_torch():`` blocks stay patched until the outermost one
    exits. Undoing a handle twice is harmless.

    Example::

        import fsdp2
        fsdp2.patch_torch()        # first, before importing the training library
        import torchtune           # its fully_shard is fsdp2's

        with fsdp2.patch_torch():  # or scoped: restored on exit
            ...
    """
    global _active
    with _lock:
        if _active == 0:
            _apply()
        _active += 1
        return TorchPatch()
