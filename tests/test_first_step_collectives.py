"""The first step's collectives are exactly upstream's, lazy init included.

fsdp2 checks at the root's lazy init that every rank shards the same model
(``fsdp2/runtime/hooks/divergence.py``), through the default process group's store rather
than a collective. So what counts the first forward's collectives sees
exactly upstream's: torch's ``CommDebugMode`` (as upstream's
``test_fully_shard_communication_count`` and
``TestFullyShardGradientAccumulation`` use it) and the wrapped
``torch.distributed`` functions of ``checks.py`` (here every public
collective, object collectives and barriers included). Each case builds one
fresh model per implementation in the same launch and compares the first
step's counts, forward and backward apart, with upstream's and with
upstream's own expectation (the first forward: one all-gather per group,
nothing else): W=2 with ``reshard_after_forward`` True, False and 2; two
micro-batches, the first without gradient sync; W=4 on a 2x2 HSDP mesh.
Under ``FSDP2_TEST_IMPL=torch`` upstream is compared with itself. On gloo:
``CommDebugMode`` counts the ops a C++ backend dispatches, which the suite's
shared-memory backend (a Python process group) does not.
"""

from __future__ import annotations

import pytest
import torch.distributed.fsdp as upstream
from _impl import fully_shard
from checks import _PATCHED, check_case, on_collectives
from models import (
    build_transformer,
    cpu_mesh,
    rank_slice,
    shard_transformer,
    transformer_batch,
    transformer_loss,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode

# Every public torch.distributed collective: the check must add none of them.
_EVERY_COLLECTIVE = {
    **_PATCHED,
    "other": (
        "broadcast", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single",
        "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
        "barrier", "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv",
    ),
}


class _Counts:
    """One phase's collectives: ``CommDebugMode``'s op counts and the wrapped functions' calls."""

    def __enter__(self):
        import torch.distributed as dist

        self.calls: list[tuple[str, int]] = []
        self._mode = CommDebugMode()
        self._wrapped = on_collectives(
            lambda kind, args, kwargs: self.calls.append(
                (kind, dist.get_world_size(kwargs.get("group")))
            ),
            _EVERY_COLLECTIVE,
        )
        self._mode.__enter__()
        self._wrapped.__enter__()
        return self

    def __exit__(self, *exc):
        self._wrapped.__exit__(*exc)
        self._mode.__exit__(*exc)
        self.ops = {str(op): n for op, n in self._mode.get_comm_counts().items()}

    def result(self) -> tuple[dict[str, int], list[tuple[str, int]]]:
        return self.ops, self.calls


def _first_step(fsdp, rank, world_size, mesh, micro_batches=1, **kwargs):
    """(forward, backward) counts of each micro-batch of a fresh model's first step."""
    model = shard_transformer(build_transformer(seed=3), fsdp, mesh=mesh, **kwargs)
    phases = []
    for i in range(micro_batches):
        model.set_requires_gradient_sync(i == micro_batches - 1)
        batch = rank_slice(transformer_batch(i, 2 * world_size), rank, world_size)
        with _Counts() as fwd:
            loss = transformer_loss(model, batch)
        with _Counts() as bwd:
            loss.backward()
        phases.append((fwd.result(), bwd.result()))
    return phases, len(model.layers) + 1


def _same_as_upstream(mesh_fn, **kwargs):
    def case(rank, world_size):
        mesh = mesh_fn(world_size)
        base, groups = _first_step(upstream.fully_shard, rank, world_size, mesh, **kwargs)
        ours, _ = _first_step(fully_shard, rank, world_size, mesh, **kwargs)
        assert ours == base, (ours, base)
        (ops, calls), _ = ours[0]
        # Upstream's own expectation for the first forward: one all-gather per group.
        assert list(ops.values()) == [groups] and "allgather" in next(iter(ops)), ops
        assert [kind for kind, _ in calls] == ["all_gather"] * groups, calls

    return case


def _hsdp_mesh(world_size):
    return init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))


CASES_2 = {
    "reshard_true": _same_as_upstream(cpu_mesh, reshard_after_forward=True),
    "reshard_false": _same_as_upstream(cpu_mesh, reshard_after_forward=False),
    "reshard_2": _same_as_upstream(cpu_mesh, reshard_after_forward=2),
    "accumulation": _same_as_upstream(cpu_mesh, micro_batches=2),
}
CASES_4 = {"hsdp": _same_as_upstream(_hsdp_mesh, micro_batches=2)}


@pytest.mark.parametrize("case", sorted(CASES_2))
def test_first_step_collectives_match_upstream(case, launch_cases):
    """W=2: the first step's forward and backward issue exactly upstream's collectives."""
    check_case(launch_cases(2, CASES_2, backend="gloo"), case)


def test_first_step_collectives_match_upstream_hsdp(launch_cases):
    """W=4, 2x2 HSDP mesh, two micro-batches: exactly upstream's collectives per phase."""
    check_case(launch_cases(4, CASES_4, backend="gloo"), "hsdp")
