"""The check, at a root's lazy init, that every rank is about to shard the same model.

[Note: Divergence check at lazy init]
A model that differs across ranks (a config read differently on one node, a
rank-dependent branch in ``__init__``) makes the ranks issue collectives of
different sizes, or in a different order: gloo aborts one rank and resets the
others' connections, NCCL hangs or silently mixes buffers. So before the root's
first collective each rank summarizes what it is about to shard, per group in
lazy-init order: the group's modules, mesh (shape, dim names, ranks),
``reshard_after_forward``, mixed-precision and offload policies, and per
parameter its FQN, global shape, dtype, ``requires_grad`` and placements. The
summary is hashed to 62 bits; ranks exchange the hashes in one ``all_reduce``
(``MAX``) of a world-sized int64 vector where rank ``r`` fills slot ``r``
(8 KiB at W = 1024), once per root. Equal hashes end the check. Otherwise every
rank has seen the same vector, so every rank takes the same slow path: the full
summaries are exchanged (``all_gather_object``) and every rank raises the same
``ValueError`` naming the first differing group and parameter, what each side
has and which ranks differ. Only matching collectives ran, so the process group
stays usable.

Which process group: the default one when the root's meshes span the whole
world (the usual case, whatever the meshes' shapes, so ranks that chose
different meshes still meet); otherwise (pipeline stages, tensor-parallel
``dp`` sub-meshes) the one group among the root's shard and replicate groups
that covers all the ranks its meshes span, or, failing that, each of those
groups in one global order, the vector accumulating (a 2-D mesh: rows, then
columns). A rank whose slot stays 0 was not reached and is not compared (under
torch's fake process group, whose collectives do nothing, only the own slot is
filled: the check passes at no cost). Under a ``FakeTensorMode`` (``fsdp2.plan``,
memory trackers) tensors hold no data, so there is nothing to compare: no check.

A rank whose own lazy-init checks failed (parameters still on ``meta``, mixed
dtypes, ...) takes part with a marker instead of its hash: it re-raises its
own error, and the other ranks raise a ``RuntimeError`` quoting it, instead
of waiting in the first all-gather for a rank that will never come.

Per step this costs nothing: it runs once per root (again only after lazy
init failed).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ._torch_compat import fake_tensors_active
from .param_group import FSDPParamGroup

logger = logging.getLogger("fsdp2.divergence")

_ERROR_MARK = 1  # the slot of a rank whose own lazy-init checks failed (hashes are >= 2)
_HASH_MASK = (1 << 62) - 1


def group_fingerprint(group: FSDPParamGroup, meshes: dict[int, str]) -> dict[str, Any]:
    """What one group shards, in the terms ranks must agree on (plain, picklable values)."""
    mesh = group.mesh_info.mesh
    key = id(mesh)
    if key not in meshes:  # formatted once per mesh: 1024 ranks are a long string
        names = tuple(mesh.mesh_dim_names or ())
        ranks = mesh.mesh.flatten().tolist()
        spans = ranks == list(range(ranks[0], ranks[0] + len(ranks)))
        meshes[key] = (
            f"shape {tuple(mesh.mesh.shape)}" + (f" dims {names}" if names else "")
            + (f" ranks {ranks[0]}..{ranks[-1]}" if spans else f" ranks {ranks}")
        )
    pf = group.post_forward_mesh_info
    mp = group.mp_policy
    return {
        "group": group.module_fqn,
        "settings": {
            "mesh": meshes[key],
            "reshard_after_forward": pf.size if pf is not None else group.reshard_after_forward,
            "mp_policy": (
                f"param_dtype={mp.param_dtype}, reduce_dtype={mp.reduce_dtype}, "
                f"output_dtype={mp.output_dtype}, cast_forward_inputs={mp.cast_forward_inputs}"
            ),
            "offload_policy": "CPUOffloadPolicy" if group.offload else "OffloadPolicy",
        },
        "params": [
            (
                p.fqn,
                (
                    f"shape {tuple(p.sharded_param.shape)}, dtype {p.sharded_param.dtype}, "
                    f"requires_grad={p.sharded_param.requires_grad}, "
                    f"placements {tuple(getattr(p.sharded_param, 'placements', ()))}"
                ),
            )
            for p in group.fsdp_params
        ],
    }


def _hash(fingerprint: list[dict[str, Any]]) -> int:
    digest = hashlib.blake2b(repr(fingerprint).encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") & _HASH_MASK) + 2


def _ranks_of(group: dist.ProcessGroup) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group))


def _exchange_groups(groups: Sequence[FSDPParamGroup]) -> list[dist.ProcessGroup | None]:
    """The process groups the check runs over, in an order every rank shares (see the note)."""
    by_ranks: dict[tuple[int, ...], dist.ProcessGroup] = {}
    union: set[int] = set()  # the ranks the meshes span (a 2-D mesh: more than its rows)
    meshes = {id(g.mesh_info.mesh): g.mesh_info for g in groups}  # most groups share one mesh
    for info in meshes.values():
        union.update(info.mesh.mesh.flatten().tolist())
        for pg in (info.shard_process_group, info.replicate_process_group):
            if pg is not None:
                by_ranks.setdefault(tuple(sorted(_ranks_of(pg))), pg)
    if len(union) <= 1:
        return []
    if len(union) == dist.get_world_size():
        return [None]  # the default group
    for ranks, pg in by_ranks.items():
        if set(ranks) == union:
            return [pg]
    return [by_ranks[r] for r in sorted(by_ranks, key=lambda r: (-len(r), r))]


def check_same_model(
    root_name: str,
    groups: Sequence[FSDPParamGroup],
    local_error: BaseException | None = None,
) -> None:
    """Raise the same ``ValueError`` on every rank if the ranks would shard different models.

    ``groups``: the root's groups in lazy-init order, named (FQNs set).
    ``local_error``: this rank's own lazy-init failure, if any; it is
    re-raised here after the exchange. See [Note: Divergence check at lazy init].
    """
    # Fake tensors (a FakeTensorMode: planning, memory tracking) hold no data to compare.
    pgs = [] if fake_tensors_active() else _exchange_groups(groups)
    if not pgs:
        if local_error is not None:
            raise local_error
        return
    meshes: dict[int, str] = {}
    fingerprint = [] if local_error else [group_fingerprint(g, meshes) for g in groups]
    mine = _ERROR_MARK if local_error is not None else _hash(fingerprint)
    device = groups[0].device
    rank, world_size = dist.get_rank(), dist.get_world_size()
    slots = torch.zeros(world_size, dtype=torch.int64, device=device)
    slots[rank] = mine
    for pg in pgs:
        dist.all_reduce(slots, op=dist.ReduceOp.MAX, group=pg)
    seen = slots.tolist()
    known = [r for r, v in enumerate(seen) if v != 0]
    if all(seen[r] == mine for r in known) and mine != _ERROR_MARK:
        logger.debug("divergence check: %s, %d groups, %d ranks agree", root_name,
                     len(groups), len(known))
        return
    if all(seen[r] == mine for r in known):  # every rank failed alike: each raises its own
        raise local_error
    # Slow path, taken by every rank alike: exchange the summaries and describe the difference.
    summary = {rank: (fingerprint, None if local_error is None else _describe(local_error))}
    for pg in pgs:
        gathered: list[Any] = [None] * dist.get_world_size(pg)
        dist.all_gather_object(gathered, summary, group=pg)
        for part in gathered:
            summary.update(part)
    if local_error is not None:
        raise local_error
    failed = {r: err for r, (_, err) in sorted(summary.items()) if err is not None}
    if failed:
        r, err = next(iter(failed.items()))
        raise RuntimeError(
            f"FSDP lazy init of '{root_name}' failed on rank{'s' if len(failed) > 1 else ''} "
            f"{sorted(failed)}, so this rank stops too instead of waiting for it in a "
            f"collective. Rank {r} raised:\n{err}"
        )
    raise ValueError(describe_divergence(root_name, {r: fp for r, (fp, _) in summary.items()}))


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def describe_divergence(root_name: str, fingerprints: dict[int, list[dict[str, Any]]]) -> str:
    """The error message: the first difference between rank ``min`` and the first rank unlike it."""
    ranks = sorted(fingerprints)
    ref_rank = ranks[0]
    ref = fingerprints[ref_rank]
    differing = [r for r in ranks if fingerprints[r] != ref]
    other = differing[0]
    where, ours, theirs = _first_difference(ref, fingerprints[other])
    return (
        f"FSDP ranks are about to shard different models under the root '{root_name}': "
        + (f"rank {differing[0]} differs" if len(differing) == 1 else f"ranks {differing} differ")
        + f" from rank {ref_rank} "
        f"(checked at the first forward, before any FSDP collective; the process group is "
        f"still usable).\n"
        f"First difference, {where}:\n"
        f"  rank {ref_rank}: {ours}\n"
        f"  rank {other}: {theirs}\n"
        "Every rank must build the same model (parameter names, shapes, dtypes, requires_grad) "
        "and call fully_shard on the same modules in the same order with the same arguments "
        "(mesh, reshard_after_forward, mp_policy, offload_policy): look for configuration read "
        "differently on some ranks or a rank-dependent branch in __init__."
    )


def _first_difference(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> tuple[str, str, str]:
    """(where, rank a's side, rank b's side) of the first difference between two summaries."""
    for i in range(max(len(a), len(b))):
        if i >= len(a) or i >= len(b):
            present = a[i] if i < len(a) else b[i]
            has = f"group '{present['group']}' with {len(present['params'])} parameters"
            sides = (has, "no such group") if i < len(a) else ("no such group", has)
            return f"FSDP group #{i} (rank counts differ: {len(a)} vs {len(b)} groups)", *sides
        ga, gb = a[i], b[i]
        if ga["group"] != gb["group"]:
            return f"FSDP group #{i}", f"group '{ga['group']}'", f"group '{gb['group']}'"
        name = ga["group"] or "<root>"
        for key, value in ga["settings"].items():
            if gb["settings"][key] != value:
                return f"in group '{name}', {key}", str(value), str(gb["settings"][key])
        pa, pb = ga["params"], gb["params"]
        for j in range(max(len(pa), len(pb))):
            if j >= len(pa) or j >= len(pb):
                extra = pa[j] if j < len(pa) else pb[j]
                has = f"parameter '{extra[0]}' ({extra[1]})"
                sides = (has, "no such parameter") if j < len(pa) else ("no such parameter", has)
                return (
                    f"in group '{name}', parameter #{j} (parameter counts differ: "
                    f"{len(pa)} vs {len(pb)})", *sides,
                )
            if pa[j][0] != pb[j][0]:
                return (
                    f"in group '{name}', parameter #{j}",
                    f"parameter '{pa[j][0]}' ({pa[j][1]})",
                    f"parameter '{pb[j][0]}' ({pb[j][1]})",
                )
            if pa[j][1] != pb[j][1]:
                return f"in group '{name}', parameter '{pa[j][0]}'", pa[j][1], pb[j][1]
    return "nowhere visible (the summaries hash differently)", "", ""
