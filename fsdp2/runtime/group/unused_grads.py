"""Gradients of parameters some ranks did not use: filled, zeroed, found unused everywhere.

``GradientReduction`` (reduction.py) calls these around each reduce-scatter.

[Note: Gradients of parameters used on some ranks]
Conditional computation (a mixture of experts routing to expert ``b`` on rank
0 only, a multi-modal branch) leaves some trainable parameters of a group
without a gradient on some ranks. Reducing only the gradients present would
give the ranks reduce-scatters of different sizes (gloo aborts, NCCL hangs or
mixes buffers). By default we give DDP's result (``find_unused_parameters``):
the mean over all ranks, counting zeros where a parameter was unused, and
``grad is None`` where it was unused on *every* rank, so optimizers skip it.

A rank that has at least one gradient of the group (it takes part in the
reduce-scatter, as before) fills a gradient for every trainable, gathered
parameter it has none for, so every rank reduces the same parameters, in the
same collective as upstream with ``set_reduce_scatter_unused_params(True)``.
The fill is ``-0.0`` instead of ``+0.0``, which carries the "had a gradient"
bit in the values themselves at no cost: in IEEE arithmetic ``-0.0 + -0.0 =
-0.0`` while ``-0.0 + x = x`` for every other ``x`` (``+0.0`` included), and
scaling, casts and the average keep the sign. So a reduced element is ``-0.0``
exactly when every rank filled it. The fill also covers the padding of the
last chunks (its rows are rounded up to whole chunks), where the gradients
of a rank that has them are always ``+0.0`` (``chunk_cat`` pads with zeros):
in a block with padding the bit is exact. A rank that filled reads its
blocks of those parameters back (one device-to-host read, only then) and
leaves ``.grad`` unset where a block is all ``-0.0``; a rank that had every
gradient reads nothing. Nothing is added to any collective: the bytes and
the collectives are upstream's, and with every gradient present (the common
case) nothing at all changes. With HSDP the all-reduce carries the sign the
same way; with the all-reduce off (accumulation) the kept partial sums
include the padding. Without sync, unsharded gradients accumulate, so "had
a gradient" means "in any micro-batch since the last reduction".

A group of several modules (``fully_shard([norm, head])``) may run in parts:
the chunked-loss pattern calls ``head`` alone once per chunk, with a backward
each, while the root's forward ran ``norm`` alone (see [Note: Groups run in
parts] in hooks.py). Every rank then lacks ``norm``'s gradient in a ``head``
use, and upstream reduces ``head``'s only. So a rank fills only parameters of
the group's modules (the ones passed to ``fully_shard``) that ran in the use
being reduced: the use's set of modules rides on its post-backward node, and
a use whose inputs need no grad (no node) is kept on the group until the
end-of-backward post-backward. A group of one module fills every parameter.

Limits: a module of a group of several that runs on some ranks only in a use
is the "group on some ranks only" error below. A block without padding relies
on the rows alone, so a parameter whose real gradients are exactly ``-0.0`` in
every element of a rank's rows (every term of every element a negative zero)
is taken as unused there; a custom reduce-scatter comm must keep the sign of
zero. A rank with *no* gradient for any parameter of the group (its module did
not run, or none of its outputs reached the loss) skips the group's reduce-
scatter, as upstream: a group must take part in backward on every rank or on
none. ``set_reduce_scatter_unused_params(True)`` is upstream's behaviour:
``+0.0`` for every trainable gathered parameter, on every rank, so a group
reduces even on a rank with no gradient at all, and a parameter unused
everywhere gets a zero gradient.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
import torch.nn as nn

from ..storage.param import FSDPParam


def fill_unused(
    fsdp_params: list[FSDPParam],
    grads: list[torch.Tensor | None],
    ran: Collection[nn.Module] | None = None,
) -> set[FSDPParam]:
    """Fill this rank's missing gradients with ``-0.0``; returns the parameters filled.

    Nothing is filled when this rank has no gradient in the group (it
    takes no part in the reduction). ``ran``: for a group of several
    modules, the modules run in the use being reduced; only their
    parameters are filled (``None``: every parameter). See [Note:
    Gradients of parameters used on some ranks].
    """
    missing = [i for i, grad in enumerate(grads) if grad is None]
    if not missing or len(missing) == len(grads):
        return set()
    if ran is not None:
        inside = params_of(fsdp_params, ran)
        missing = [i for i in missing if fsdp_params[i] in inside]
    filled = set()
    for i in missing:
        grads[i] = fsdp_params[i].negative_zero_grad()
        if grads[i] is not None:
            filled.add(fsdp_params[i])
    return filled


def zero_unused(fsdp_params: list[FSDPParam], grads: list[torch.Tensor | None]) -> None:
    """``set_reduce_scatter_unused_params(True)``: zeros for trainable params with no grad.

    Every rank then reduce-scatters the same parameters, whichever ones its
    own backward reached (conditional computation: mixture of experts,
    multi-modal branches), as DDP's ``find_unused_parameters``. A parameter
    never all-gathered has nothing to reduce.
    """
    for i, (p, grad) in enumerate(zip(fsdp_params, grads)):
        if grad is None:
            grads[i] = p.zero_unsharded_grad()


def unused_everywhere(
    blocks: list[torch.Tensor], fsdp_params: list[FSDPParam], filled: set[FSDPParam]
) -> set[FSDPParam]:
    """Of the parameters this rank filled, those whose reduced block is all ``-0.0``.

    One device-to-host read, only on a rank that filled; see [Note: Gradients
    of parameters used on some ranks].
    """
    checked = [(p, block) for p, block in zip(fsdp_params, blocks) if p in filled]
    verdicts = torch.stack(
        [torch.signbit(block).all() & (block == 0).all() for _, block in checked]
    ).tolist()
    return {p for (p, _), unused in zip(checked, verdicts) if unused}


def params_of(fsdp_params: list[FSDPParam], modules: Collection[nn.Module]) -> set[FSDPParam]:
    """The parameters held by ``modules`` or their submodules (tied ones by any holder)."""
    holders = {sub for module in modules for sub in module.modules()}
    return {p for p in fsdp_params if any(m in holders for m, _ in p.module_infos)}
