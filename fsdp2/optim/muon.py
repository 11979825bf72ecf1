"""Muon for sharded models: each matrix orthogonalized whole, once, on one rank.

[Note: Muon on sharded parameters]
Muon (Jordan et al. 2024, https://kellerjordan.github.io/posts/muon/) keeps a
momentum buffer per matrix and replaces the update by its Newton-Schulz
orthogonalization, which mixes every element of the matrix. Under
``fully_shard`` each rank holds only its rows (``Shard(0)``), so
``torch.optim.Muon`` cannot run on them, and the usual workaround
(``full_tensor()`` of every update on every rank) moves ``W`` times the bytes
and repeats the same Newton-Schulz ``W`` times.

``fsdp2.Muon`` splits the step where the math allows:

1. momentum, elementwise, on each rank's own rows:
   ``buf.lerp_(grad, 1 - momentum)``, then ``grad.lerp(buf, momentum)`` (Nesterov)
   or ``buf``; the buffer stays a sharded DTensor like the parameter, so
   ``state_dict()`` and DCP reshard it with the model;
2. one all-to-all per shard group sends each matrix's rows of that update to
   the matrix's owner (see [Note: Muon owners] in ``muon_plan.py``);
3. each owner orthogonalizes the matrices it owns, same-shape ones together
   in one batched Newton-Schulz (``baddbmm``);
4. a second all-to-all returns each rank its rows of the result (bf16, the
   dtype Newton-Schulz produces), and each rank applies decoupled weight
   decay and the update to its own rows.

Per step and rank this moves about ``1.5/W`` of the workaround's bytes (the
update in, in the gradient dtype; the result out, in bf16) and does ``1/W`` of
its Newton-Schulz work plus the imbalance of the owner assignment. Forward and
backward are untouched.

Every op is the one ``torch.optim.Muon`` runs on the whole matrix, with the
same operands: the elementwise ops give the same bits on any slice of rows,
and the batched matmuls are checked against the per-matrix ones the first
time each shape is seen on a device (falling back to one matrix at a time if
they differ), so the result equals single-device Muon to the bit.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .._torch_compat import local_tensor
from .muon_plan import MuonLoad, Plan, Unit, assign_owners, check_param, layout_of

__all__ = ["Muon", "MuonLoad"]

logger = logging.getLogger(__name__)

# Keller Jordan's quintic coefficients and defaults, as torch.optim.Muon's
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
EPS = 1e-7
_ADJUST_LR_FNS = (None, "original", "match_rms_adamw", "spectral_unclamped")


class Muon(torch.optim.Optimizer):
    """``torch.optim.Muon`` for sharded parameters, equal to it bit for bit.

    Same arguments, defaults and state (``momentum_buffer``, a DTensor sharded
    like its parameter) as ``torch.optim.Muon``. Takes the 2-D matrices of a
    model sharded by ``fully_shard`` (Shard(0) over a 1-D mesh, or HSDP's
    (Replicate(), Shard(0))), plain tensors, and 3-D stacks of matrices
    (expert weights: one matrix per leading index, each stepped as
    ``torch.optim.Muon`` steps a 2-D parameter), expert-parallel ones too
    (see [Note: Muon on expert-parallel stacks] in muon_plan.py). Each matrix is
    orthogonalized on one owner rank of its shard group; see [Note: Muon on
    sharded parameters]. Pass named parameters to get names in errors.

    Use it for the hidden matrices and AdamW for the rest, as the Muon recipe
    says::

        hidden = [(n, p) for n, p in model.named_parameters()
                  if p.ndim >= 2 and "embed" not in n and "output" not in n]
        rest = [p for n, p in model.named_parameters() if n not in dict(hidden)]
        muon = fsdp2.Muon(hidden, lr=0.02, weight_decay=0.1)
        adamw = torch.optim.AdamW(rest, lr=3e-4)

    Every rank must step the same parameters with the same gradients present
    (as with any collective). Gradients of a DTensor parameter must be
    DTensors with its placements, as ``fully_shard`` makes them.
    """

    def __init__(
        self,
        params: Any,
        lr: float | torch.Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = EPS,
        ns_steps: int = NS_STEPS,
        adjust_lr_fn: str | None = None,
    ) -> None:
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not 0.0 <= lr:
            raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
        if not 0.0 <= momentum:
            raise ValueError(f"momentum should be >= 0 but is: {momentum}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"weight decay should be >= 0 but is: {weight_decay}")
        if adjust_lr_fn not in _ADJUST_LR_FNS:
            raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported")
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": ns_coefficients,
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
        }
        self._plan: Plan | None = None
        self._plan_key: tuple = ()
        # (matrix shape, device type) -> whether batched matmuls match per-matrix ones
        self._batch_ok: dict[tuple, bool] = {}
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group as ``torch.optim.Optimizer`` does, checking every parameter first."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if len(group["ns_coefficients"]) != 3:
            raise ValueError("Coefficients must be a tuple of exactly 3 values")
        if group["ns_steps"] >= 100:
            raise ValueError("Number of steps must be less than 100 for computational efficiency")
        for name, p in zip(_names(group, len(self.param_groups) - 1), group["params"]):
            check_param(p, name)
        self._plan = None

    def load_balance(self) -> list[MuonLoad]:
        """Newton-Schulz flops per rank, one entry per shard group (see ``MuonLoad``)."""
        return self._current_plan().loads

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One Muon step on every parameter with a gradient (collective: call on every rank)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        plan = self._current_plan()
        updates = self._momentum()
        if not updates:
            return loss
        rows = self._orthogonalize(plan, updates)
        self._apply(plan, updates, rows)
        return loss

    # ---------------------------------------------------------------- step phases

    def _momentum(self) -> dict[torch.Tensor, tuple[torch.Tensor, dict]]:
        """Per parameter with a gradient: its local rows of the momentum update, and its group."""
        updates: dict[torch.Tensor, tuple[torch.Tensor, dict]] = {}
        for gi, group in enumerate(self.param_groups):
            momentum = group["momentum"]
            for name, p in zip(_names(group, gi), group["params"]):
                if p.grad is None:
                    continue
                grad = _local_grad(p, name)
                if grad.is_sparse:
                    raise RuntimeError("Muon does not support sparse gradients")
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(
                        p.grad, memory_format=torch.preserve_format
                    )
                buf = state["momentum_buffer"]
                buf = local_tensor(buf) if isinstance(buf, DTensor) else buf
                buf.lerp_(grad, 1 - momentum)
                update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                updates[p] = (update, group)
        return updates

    def _orthogonalize(
        self, plan: Plan, updates: dict[torch.Tensor, tuple[torch.Tensor, dict]]
    ) -> dict[int, torch.Tensor]:
        """This rank's rows of every matrix's orthogonalized update, by unit index."""
        units = [u for u in plan.units if u.layout.param in updates]
        whole: dict[int, list[torch.Tensor]] = {}  # unit index -> pieces along the split dim
        by_group: dict[int, list[Unit]] = {}
        for u in units:
            update = _matrix(updates[u.layout.param][0], u.expert)
            if u.layout.moves_rows:
                by_group.setdefault(id(u.layout.group), []).append(u)
            else:
                whole[u.index] = [update.to(u.layout.comm_device or update.device)]
        for moved in by_group.values():
            whole.update(_to_owners(moved, updates))
        ortho = self._newton_schulz(units, whole, updates)
        rows: dict[int, torch.Tensor] = {
            u.index: ortho[u.index] for u in units if not u.layout.moves_rows
        }
        for moved in by_group.values():
            rows.update(_from_owners(moved, ortho))
        return rows

    def _newton_schulz(
        self,
        units: list[Unit],
        whole: dict[int, list[torch.Tensor]],
        updates: dict[torch.Tensor, tuple[torch.Tensor, dict]],
    ) -> dict[int, torch.Tensor]:
        """Orthogonalize the matrices this rank has whole, same-shape ones in one batch."""
        batches: dict[tuple, list[Unit]] = {}
        for u in units:
            if u.index not in whole:
                continue
            group = updates[u.layout.param][1]
            pieces = whole[u.index]
            key = (
                u.layout.matrix_shape,
                pieces[0].device,
                tuple(group["ns_coefficients"]),
                group["ns_steps"],
                group["eps"],
            )
            batches.setdefault(key, []).append(u)
        out: dict[int, torch.Tensor] = {}
        for (shape, device, coefficients, steps, eps), members in batches.items():
            x = torch.empty((len(members), *shape), dtype=torch.bfloat16, device=device)
            for i, u in enumerate(members):
                _fill(x[i], whole[u.index], u)
            ok_key = (shape, device.type)
            batched = len(members) > 1 and self._batch_ok.get(ok_key, True)
            if batched and ok_key not in self._batch_ok:
                result = newton_schulz(x.clone(), coefficients, steps, eps, batched=True)
                ref = newton_schulz(x, coefficients, steps, eps, batched=False)
                self._batch_ok[ok_key] = torch.equal(result, ref)
                if not self._batch_ok[ok_key]:
                    logger.info("batched Newton-Schulz differs for %s on %s", shape, device)
                result = ref
            else:
                result = newton_schulz(x, coefficients, steps, eps, batched=batched)
            for i, u in enumerate(members):
                out[u.index] = result[i]
        return out

    def _apply(
        self,
        plan: Plan,
        updates: dict[torch.Tensor, tuple[torch.Tensor, dict]],
        rows: dict[int, torch.Tensor],
    ) -> None:
        """Decoupled weight decay, then ``-adjusted_lr * update``, on this rank's rows."""
        units_of: dict[torch.Tensor, list[Unit]] = {}
        for u in plan.units:
            units_of.setdefault(u.layout.param, []).append(u)
        for p, (_, group) in updates.items():
            lr = group["lr"]
            # torch.optim.Muon keeps a tensor lr a 0-d tensor: lr * ratio in its dtype.
            lr = lr.squeeze() if isinstance(lr, torch.Tensor) else lr
            local = local_tensor(p) if isinstance(p, DTensor) else p
            adjusted_lr = _adjust_lr(lr, group["adjust_lr_fn"], tuple(p.shape[-2:]))
            local.mul_(1 - lr * group["weight_decay"])
            for u in units_of.get(p, []):
                update = rows[u.index].to(local.device)
                _matrix(local, u.expert).add_(update, alpha=-adjusted_lr)

    def _current_plan(self) -> Plan:
        key = tuple(
            (id(p), group["ns_steps"]) for group in self.param_groups for p in group["params"]
        )
        if self._plan is None or key != self._plan_key:
            layouts, steps = [], []
            for gi, group in enumerate(self.param_groups):
                for name, p in zip(_names(group, gi), group["params"]):
                    layouts.append(layout_of(p, name))
                    steps.append(group["ns_steps"])
            self._plan, self._plan_key = assign_owners(layouts, steps), key
        return self._plan


def newton_schulz(
    x: torch.Tensor,
    coefficients: tuple[float, float, float],
    steps: int,
    eps: float,
    batched: bool = True,
) -> torch.Tensor:
    """Quintic Newton-Schulz orthogonalization of each bf16 matrix of ``x`` (k, m, n), in place.

    The same ops as ``torch.optim.Muon`` on one matrix: scale to Frobenius
    norm 1, then ``steps`` times ``A = X X^T; B = bA + cA^2; X = aX + BX`` on
    the wide orientation. ``batched`` runs the matmuls as ``baddbmm`` over all
    ``k`` matrices at once; otherwise one matrix at a time with ``addmm``.
    """
    a, b, c = coefficients
    tall = x.size(-2) > x.size(-1)
    xs = x.mT if tall else x
    for m in xs:
        m.div_(m.norm().clamp(min=eps))
    if batched:
        for _ in range(steps):
            gram = xs @ xs.mT
            gram_update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            xs = torch.baddbmm(xs, gram_update, xs, beta=a)
        return xs.mT if tall else xs
    out = []
    for m in xs:
        for _ in range(steps):
            gram = m @ m.T
            gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            m = torch.addmm(m, gram_update, m, beta=a)
        out.append(m.T if tall else m)
    return torch.stack(out)


def _adjust_lr(
    lr: float | torch.Tensor, adjust_lr_fn: str | None, shape: tuple[int, int]
) -> float | torch.Tensor:
    """The learning rate scaled for a matrix's shape, as ``torch.optim.Muon`` scales it."""
    rows, cols = shape
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    elif adjust_lr_fn == "spectral_unclamped":
        ratio = math.sqrt(rows / cols)
    else:
        ratio = 1.0
    return lr * ratio


# ---------------------------------------------------------------- row exchange


def _to_owners(
    moved: list[Unit], updates: dict[torch.Tensor, tuple[torch.Tensor, dict]]
) -> dict[int, list[torch.Tensor]]:
    """All-to-all: each owner receives every rank's rows of its matrices, per matrix."""
    layout = moved[0].layout
    me, world, device = layout.rank, layout.world_size, layout.comm_device
    send: list[list[torch.Tensor]] = [[] for _ in range(world)]
    mine: dict[int, torch.Tensor] = {}
    for u in moved:
        rows = _matrix(updates[u.layout.param][0], u.expert)
        if u.owner == me:
            mine[u.index] = rows.to(device)
        else:
            send[u.owner].append(rows.reshape(-1).view(torch.uint8))
    owned = [u for u in moved if u.owner == me]
    dtypes = {u.index: updates[u.layout.param][0].dtype for u in owned}
    recv_sizes = [
        0 if j == me else sum(_numel(u, j) * dtypes[u.index].itemsize for u in owned)
        for j in range(world)
    ]
    recv = _all_to_all(send, recv_sizes, torch.uint8, device, layout.group)
    whole: dict[int, list[torch.Tensor]] = {u.index: [] for u in owned}
    for j in range(world):
        offset = 0
        for u in owned:
            if j == me:
                whole[u.index].append(mine[u.index])
                continue
            nbytes = _numel(u, j) * dtypes[u.index].itemsize
            piece = recv[j][offset : offset + nbytes].view(dtypes[u.index])
            whole[u.index].append(piece.view(_chunk_shape(u, j)))
            offset += nbytes
    return whole


def _from_owners(moved: list[Unit], ortho: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """All-to-all back: each rank receives its rows of every orthogonalized matrix."""
    layout = moved[0].layout
    me, world, device = layout.rank, layout.world_size, layout.comm_device
    send: list[list[torch.Tensor]] = [[] for _ in range(world)]
    rows: dict[int, torch.Tensor] = {}
    for u in moved:
        if u.owner != me:
            continue
        full, d = ortho[u.index], u.layout.matrix_shard_dim
        offsets, sizes = u.layout.offsets, u.layout.sizes
        for j in range(world):
            block = full.narrow(d, offsets[j], sizes[j])
            if j == me:
                rows[u.index] = block
            else:
                send[j].append(block.reshape(-1))
    from_peer = [[u for u in moved if u.owner == j] for j in range(world)]
    recv_sizes = [
        0 if j == me else sum(_numel(u, me) for u in from_peer[j]) for j in range(world)
    ]
    recv = _all_to_all(send, recv_sizes, torch.bfloat16, device, layout.group)
    for j in range(world):
        offset = 0
        for u in from_peer[j] if j != me else []:
            n = _numel(u, me)
            rows[u.index] = recv[j][offset : offset + n].view(_chunk_shape(u, me))
            offset += n
    return rows


def _all_to_all(
    send: list[list[torch.Tensor]],
    recv_sizes: list[int],
    dtype: torch.dtype,
    device: torch.device,
    group: dist.ProcessGroup,
) -> list[torch.Tensor]:
    """One ``all_to_all_single`` of the concatenated ``send[j]``; the received block per rank."""
    send_sizes = [sum(t.numel() for t in pieces) for pieces in send]
    flat = [t.to(device) for pieces in send for t in pieces]
    inp = torch.cat(flat) if flat else torch.empty(0, dtype=dtype, device=device)
    out = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
    dist.all_to_all_single(out, inp, recv_sizes, send_sizes, group=group)
    return list(out.split(recv_sizes))


# ---------------------------------------------------------------- small helpers


def _names(group: dict, index: int) -> list[str]:
    names = group.get("param_names")
    if names:
        return list(names)
    return [f"param_groups[{index}]['params'][{i}]" for i in range(len(group["params"]))]


def _local_grad(p: torch.Tensor, name: str) -> torch.Tensor:
    grad = p.grad
    if not isinstance(p, DTensor):
        return grad
    if (
        not isinstance(grad, DTensor)
        or grad.placements != p.placements
        or grad.device_mesh != p.device_mesh
    ):
        raise ValueError(
            f"fsdp2.Muon: the gradient of {name} is {type(grad).__name__}"
            f"{getattr(grad, 'placements', '')}, not a DTensor with the parameter's placements "
            f"{p.placements}; reduce gradients with fully_shard (or redistribute them) first"
        )
    return local_tensor(grad)


def _matrix(t: torch.Tensor, expert: int | None) -> torch.Tensor:
    return t if expert is None else t[expert]


def _chunk_shape(u: Unit, j: int) -> list[int]:
    shape = list(u.layout.matrix_shape)
    shape[u.layout.matrix_shard_dim] = u.layout.sizes[j]
    return shape


def _numel(u: Unit, j: int) -> int:
    return math.prod(_chunk_shape(u, j))


def _fill(x: torch.Tensor, pieces: list[torch.Tensor], u: Unit) -> None:
    """Copy (and round to bf16) a matrix's pieces into ``x``, along its split dim."""
    if len(pieces) == 1:
        x.copy_(pieces[0])
        return
    d = u.layout.matrix_shard_dim
    for piece, offset, size in zip(pieces, u.layout.offsets, u.layout.sizes):
        if size:
            x.narrow(d, offset, size).copy_(piece)
