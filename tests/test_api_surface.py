"""fsdp2's public API against the installed torch's: names, and the signature of every callable.

Upstream's FSDP2 names are the ones ``torch.distributed.fsdp`` re-exports from
its ``_fully_shard`` package (FSDP1's classes live elsewhere). fsdp2 must
export each of them, and ``fully_shard``, every public ``FSDPModule`` method,
``UnshardHandle.wait``, ``register_fsdp_forward_method``, ``share_comm_ctx``
and the policy / mesh-dims classes must take the same parameters (names,
kinds, defaults) as torch's. A torch release that adds a name, a method or
an argument fails here, naming it. fsdp2 offers newer releases' API on older
torch too: on a torch before the release that added them, exactly the names in
``fsdp2.versions.ADDED_IN`` are allowed beyond torch's. These tests read
signatures only: they pass whichever implementation ``FSDP2_TEST_IMPL`` selects.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch.distributed.fsdp as tfsdp
import torch.distributed.fsdp._fully_shard as upstream_pkg
import torch.nn as nn

import fsdp2
from fsdp2.integrations.patch import PATCHED_NAMES
from fsdp2.versions import ADDED_IN, upstream_has

#: fsdp2's names from newer torch releases that the installed torch lacks.
NEWER = {name for name in ADDED_IN if not upstream_has(name)}


def _torch_fsdp2_names() -> set[str]:
    """The FSDP2 names in torch.distributed.fsdp.__all__ (those from the _fully_shard package)."""
    return {
        name for name in tfsdp.__all__
        if getattr(upstream_pkg, name, None) is not None
        and getattr(tfsdp, name) is getattr(upstream_pkg, name)
    }


def _params(fn) -> list[tuple[str, str, str]]:
    """(name, kind, repr(default)) of every parameter; annotations are left out."""
    return [
        (p.name, p.kind.name, "<none>" if p.default is p.empty else repr(p.default))
        for p in inspect.signature(fn).parameters.values()
    ]


def _diff(ours, theirs) -> str:
    return f"\n  torch: {theirs}\n  fsdp2: {ours}"


def test_fsdp2_exports_every_fsdp2_name_of_torch():
    """Every FSDP2 name in torch.distributed.fsdp.__all__ is in fsdp2.__all__ and rerouted by patch_torch."""
    theirs = _torch_fsdp2_names()
    assert "fully_shard" in theirs and "FSDPModule" in theirs, theirs  # the rule still finds them
    missing = theirs - set(fsdp2.__all__)
    assert not missing, f"torch.distributed.fsdp exports FSDP2 names fsdp2 lacks: {sorted(missing)}"
    assert set(PATCHED_NAMES) - NEWER == theirs, _diff(sorted(PATCHED_NAMES), sorted(theirs))
    assert all(hasattr(fsdp2, name) for name in PATCHED_NAMES)


def test_fully_shard_signature_matches_torch():
    """fully_shard takes torch's parameters: names, kinds and defaults, in order."""
    ours = [p for p in _params(fsdp2.fully_shard) if f"fully_shard.{p[0]}" not in NEWER]
    assert ours == _params(tfsdp.fully_shard), _diff(ours, _params(tfsdp.fully_shard))


def _public_methods(cls: type) -> dict[str, object]:
    return {
        name: member for name, member in vars(cls).items()
        if not name.startswith("_") and callable(member)
    }


#: Public FSDPModule methods that upstream does not have.
FSDP2_ONLY_METHODS = {"finish_backward", "set_gradient_comm_policy"}


def test_every_fsdp_module_method_matches_torch():
    """Each public FSDPModule method of torch exists on fsdp2's with the same parameters."""
    theirs = _public_methods(tfsdp.FSDPModule)
    ours = {name: getattr(fsdp2.FSDPModule, name, None) for name in theirs}
    missing = sorted(name for name, fn in ours.items() if fn is None)
    assert not missing, f"torch's FSDPModule has methods fsdp2's lacks: {missing}"
    mismatched = {
        name: _diff(_params(ours[name]), _params(fn))
        for name, fn in theirs.items() if _params(ours[name]) != _params(fn)
    }
    assert not mismatched, "".join(f"\n{n}:{d}" for n, d in mismatched.items())
    # fsdp2's own public methods are nn.Module's, overridden with its signature, or
    # documented additions (docs/api.md, "Controlling a sharded module")
    newer = {name.removeprefix("FSDPModule.") for name in NEWER}
    extra = set(_public_methods(fsdp2.FSDPModule)) - set(theirs) - FSDP2_ONLY_METHODS - newer
    for name in extra:
        assert _params(getattr(fsdp2.FSDPModule, name)) == _params(getattr(nn.Module, name)), name


def test_functions_and_handle_match_torch():
    """register_fsdp_forward_method, share_comm_ctx and the handles' wait take torch's parameters."""
    for name in ("register_fsdp_forward_method", "share_comm_ctx"):
        assert _params(getattr(fsdp2, name)) == _params(getattr(tfsdp, name)), name
    assert _params(fsdp2.UnshardHandle.wait) == _params(tfsdp.UnshardHandle.wait)
    if upstream_has("GradientReductionHandle"):
        theirs = tfsdp.GradientReductionHandle.wait
        assert _params(fsdp2.GradientReductionHandle.wait) == _params(theirs)


def test_value_classes_have_torch_fields():
    """MixedPrecisionPolicy, the offload policies and DataParallelMeshDims: same fields and defaults."""
    classes = ("MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy", "DataParallelMeshDims")
    for name in (c for c in classes if c not in NEWER):
        ours, theirs = getattr(fsdp2, name), getattr(tfsdp, name)
        fields = [(f.name, repr(f.default)) for f in dataclasses.fields(theirs)]
        ours_fields = [
            (f.name, repr(f.default)) for f in dataclasses.fields(ours)
            if f"{name}.{f.name}" not in NEWER
        ]
        assert ours_fields == fields, name
        public = {n for n in vars(theirs) if not n.startswith("_")} - {f[0] for f in fields}
        missing = {n for n in public if not hasattr(ours, n)}
        assert not missing, f"{name}: fsdp2's class lacks {sorted(missing)}"
    dims = fsdp2.DataParallelMeshDims(shard=("a", "b"), replicate="r")
    assert (dims.shard_names, dims.replicate_names) == (("a", "b"), ("r",))
