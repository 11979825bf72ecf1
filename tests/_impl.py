"""Select the FSDP2 implementation under test.

``FSDP2_TEST_IMPL=fsdp2`` (default) tests this repository's ``fsdp2``;
``FSDP2_TEST_IMPL=torch`` runs the very same tests against upstream
``torch.distributed.fsdp`` to validate the tests themselves.
"""

from __future__ import annotations

import os

import pytest

IMPL = os.environ.get("FSDP2_TEST_IMPL", "fsdp2").strip().lower()
if IMPL not in ("fsdp2", "torch"):
    raise RuntimeError(f"FSDP2_TEST_IMPL must be 'fsdp2' or 'torch', got {IMPL!r}")

if IMPL == "torch":
    import torch.distributed.fsdp as _upstream
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        FSDPModule,
        MixedPrecisionPolicy,
        OffloadPolicy,
        UnshardHandle,
        fully_shard,
        register_fsdp_forward_method,
    )

    # New in torch 2.12 / 2.13: None on an older torch (e.g. 2.11), so the rest of
    # the suite still imports; the tests that use them fail there.
    DataParallelMeshDims = getattr(_upstream, "DataParallelMeshDims", None)
    share_comm_ctx = getattr(_upstream, "share_comm_ctx", None)
    GradientReductionHandle = getattr(_upstream, "GradientReductionHandle", None)  # 2.15
    try:  # 2.12 and later, private in torch
        from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    except ImportError:
        ShardPlacementResult = None
else:
    from fsdp2 import (  # type: ignore[no-redef]
        CPUOffloadPolicy,
        DataParallelMeshDims,
        FSDPModule,
        GradientReductionHandle,
        MixedPrecisionPolicy,
        OffloadPolicy,
        ShardPlacementResult,
        UnshardHandle,
        fully_shard,
        register_fsdp_forward_method,
        share_comm_ctx,
    )

#: Marks tests of fsdp2-specific behaviour (error messages, features that are
#: intentionally NotImplemented for now).  Upstream torch differs there, so they
#: are skipped only when validating the suite against ``FSDP2_TEST_IMPL=torch``.
fsdp2_only = pytest.mark.skipif(
    IMPL == "torch", reason="fsdp2-specific behaviour/message; upstream torch differs"
)

def needs_upstream(name: str):
    """Skip under ``FSDP2_TEST_IMPL=torch`` where the installed torch lacks ``name``.

    ``name`` is a key of ``fsdp2.versions.ADDED_IN``: API fsdp2 offers on every
    torch but upstream only from a later release, so on an older torch there is
    no upstream to validate the test against.
    """
    from fsdp2.versions import upstream_has

    return pytest.mark.skipif(
        IMPL == "torch" and not upstream_has(name), reason=f"upstream's torch lacks {name}"
    )


__all__ = [
    "IMPL",
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "GradientReductionHandle",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "ShardPlacementResult",
    "UnshardHandle",
    "fully_shard",
    "fsdp2_only",
    "needs_upstream",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]
