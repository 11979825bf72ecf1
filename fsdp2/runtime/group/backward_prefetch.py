"""The default backward prefetch: which groups a group's pre-backward starts gathering.

[Note: Default backward prefetch]
Backward runs groups in reverse forward order, so by default a group's
pre-backward starts the all-gather of the group that ran just before this
use in forward (``CommContext.post_forward_order``), overlapping it with this
group's backward compute. A state of several groups (see [Note:
Per-parameter meshes] in param_meshes.py) follows upstream: autograd reaches
its groups last-first, and only the group of index 1 prefetches, walking back
past the entries of its own modules to every consecutive entry of the module
that ran before (latest first). Group 0, whose reduction is the state's last,
prefetches nothing, so the next module's all-gather overlaps that reduction
without holding gathered parameters any longer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .param_group import FSDPParamGroup


def prefetch_previous(group: FSDPParamGroup) -> None:
    """Start the default backward prefetch of ``group``'s pre-backward (see the Note)."""
    indices = group.step.post_forward_indices
    if not indices:
        return  # cleared by an earlier backward of the same forward
    index = indices.pop()
    order = group.comm_ctx.post_forward_order
    if group.count == 1:
        if index > 0 and order[index - 1] is not group:
            order[index - 1].prefetch(in_backward=True)
        return
    if group.index != 1:
        return
    target_modules = None
    for earlier in reversed(order[:index]):
        if earlier.modules is group.modules:
            continue
        if target_modules is None:
            target_modules = earlier.modules
        elif earlier.modules is not target_modules:
            break
        earlier.prefetch(in_backward=True)
