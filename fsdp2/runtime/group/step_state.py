"""What the training steps do to a parameter group: its phase, gathered parameters, uses.

``FSDPParamGroup`` holds what a group *is* (its parameters, flat buffer,
modules, meshes, policies); what forward and backward do to it lives in one
``StepState`` it owns, so where a group stands is read in one place and a
failed step is forgotten field by field (``FSDPParamGroup.reset_iter_state``).
What every group under one root shares (streams, forward order) is the
``CommContext`` (comm_context.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto

import torch
import torch.distributed as dist
import torch.nn as nn

from ..comm.staged_collectives import StagedAllGather


class TrainingState(Enum):
    IDLE = auto()  # between uses
    FORWARD = auto()  # inside the forward of one of the group's modules
    PRE_BACKWARD = auto()  # unsharded for backward, gradients being computed
    POST_BACKWARD = auto()  # gradients reduced (for this use)


@dataclass
class PendingAllGather:
    """An all-gather issued and not yet copied out (``FSDPParamGroup.unshard``)."""

    work: dist.Work | None  # None when the collective ran synchronously
    output: torch.Tensor
    input: torch.Tensor  # kept alive until the work is done


@dataclass(eq=False)
class StepState:
    """One group's progress through forward and backward; changed by the group only."""

    training_state: TrainingState = TrainingState.IDLE
    # Gathered parameters (FSDPParamGroup.unshard / reshard).
    is_unsharded: bool = False
    pending_unshard: PendingAllGather | None = None
    pending_staged: StagedAllGather | None = None
    # Recorded after an all-gather issued on FSDP's streams; see [Note: Streams] in comm_context.py
    unshard_event: object | None = None
    # This rank's share over the post-forward group; see [Note: Resharding to a
    # smaller group after forward] in param_group.py.
    post_forward_flat: torch.Tensor | None = None
    post_forward_event: object | None = None  # recorded after it was written (FSDP's streams)
    # Where each use of this iteration sits in CommContext.post_forward_order,
    # popped by backward prefetching.
    post_forward_indices: list[int] = field(default_factory=list)
    # Groups of several modules: the modules run in the current use, and those of
    # the uses with no post-backward node of their own (inputs that need no grad)
    # whose gradients are not reduced yet. See [Note: Gradients of parameters used
    # on some ranks] in reduction.py.
    use: set[nn.Module] | None = None
    uses_without_node: list[set[nn.Module]] = field(default_factory=list)
    # Gradients held unreduced (sync off) or not reached by autograd under
    # manual finalization: FSDPModule.finalize_backward reduces them.
    post_backward_pending: bool = False

    def record_module_run(
        self, module: nn.Module, starts_use: bool, several: bool
    ) -> set[nn.Module] | None:
        """Note that ``module`` runs in this use; returns the use's modules (groups of
        ``several`` modules; else None)."""
        if not several:
            return None
        if starts_use or self.use is None:
            self.use = set()
        self.use.add(module)
        return self.use

    def add_use_without_node(self, use: set[nn.Module] | None) -> None:
        """A use whose inputs need no grad: its gradients are reduced at the end of backward."""
        if use is not None:
            self.uses_without_node.append(use)

    def take_use(self, use: set[nn.Module] | None, several: bool) -> set[nn.Module] | None:
        """The modules whose parameters a post-backward may fill (``None``: all)."""
        if not several or use is not None:
            return use
        ran = set().union(*self.uses_without_node)
        self.uses_without_node.clear()
        return ran
