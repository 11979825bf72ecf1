"""The check, at a root's lazy init, that every rank is about to shard the same model.

[Note: Divergence check at lazy init]
A model that differs across ranks (a config read differently on one node, a
rank-dependent branch in ``__init__``) makes the ranks issue collectives of
different sizes, or in a different order: gloo aborts one rank and resets the
others' connections, NCCL hangs or silently mixes buffers. So before the root's
first collective each rank summarizes what it is about to shard, per group in
lazy-init order: the group's modules, mesh (shape, dim names, rank offsets),
``reshard_after_forward``, mixed-precision and offload policies, and per
parameter its FQN, global shape, dtype, ``requires_grad`` and placements, and
hashes the summary.

The ranks compare hashes through the default process group's key-value store
(the rendezvous TCPStore / FileStore, or the HashStore of thread ranks), not
through a collective: the training process groups see nothing, so the first
step issues exactly upstream's collectives (``CommDebugMode`` and
communication-count tests agree), and no device is synchronized. The
participants are the ranks the root's meshes span; the keys live under
``fsdp2/divergence/<participants digest>/<k>/``, ``k`` counting the checks on
those ranks so far (per default process group: thread ranks share one
process), so a check re-run after a failed lazy init uses fresh keys on every
rank. Per rank, O(1) store operations (``exchange``):

1. every rank ``append``s itself to ``who``; the lowest participant, the
   reference, ``set``s ``ref`` to its hash; every other rank ``get``s it (a
   blocking read) and, if its own hash differs, ``append``s itself to
   ``bad``; a rank whose own lazy-init checks failed (parameters still on
   ``meta``, mixed dtypes, ...) appends itself to ``failed`` instead;
2. every rank ``add``s 1 to ``arrived``; the rank whose ``add`` returns the
   participant count reads ``bad``, ``failed`` and ``abort`` and ``set``s the
   verdict in ``done``; every rank ``get``s it;
3. only on a mismatch: the first bad rank publishes its full summary, the
   reference reads it, compares it with its own and publishes the error
   message, which every rank reads (one summary crosses the store, not W); if
   some rank failed, the first failed rank publishes its error text instead;
4. every rank ``add``s 1 to ``left``; the last one deletes the check's keys.

So every rank reaches the same verdict and raises the same error: a
``ValueError`` naming the first differing group and parameter, what each side
has and which ranks differ from the reference; a ``RuntimeError`` quoting the
first failed rank's error (each failed rank re-raises its own). The process
groups were never touched, so they stay usable. A participant that never
arrives (crashed, stuck, different meshes) makes the others' blocking read
fail at the store's timeout: each raises a ``RuntimeError`` naming the key it
waited for and the ranks missing from ``who``, and leaves that message in
``abort`` for the ranks still to come. The store's load per check is O(W)
small requests in all (about six per rank; ``benchmarks/bench_divergence.py``
measures W = 16384 on one TCPStore) and nothing stays behind.

No check where there is nothing to compare or nobody to compare with: under a
``FakeTensorMode`` (``fsdp2.plan``, memory trackers) tensors hold no data; on
torch's fake process group (backend ``"fake"``) one process plays every rank
and its store is a stub; a root whose meshes span one rank.

Per step this costs nothing: it runs once per root (again only after lazy
init failed).
"""

from __future__ import annotations

import hashlib
import json
import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..._torch_compat import default_store, fake_tensors_active
from ..group.param_group import FSDPParamGroup

logger = logging.getLogger(__name__)

_FAILED = "!"  # the reference's ``ref`` when its own lazy init failed (hashes are hex)
_KEYS = ("ref", "bad", "failed", "who", "arrived", "abort", "done",
         "bad_summary", "message", "error", "left")

# Checks so far per default process group and participants: the next one's key prefix.
# Keyed by the process group, not global: thread ranks (torch's threaded PG) share globals.
_CHECKS: weakref.WeakKeyDictionary[Any, dict[tuple[int, ...], int]] = weakref.WeakKeyDictionary()


def group_fingerprint(group: FSDPParamGroup, meshes: dict[int, str]) -> dict[str, Any]:
    """What one group shards, in the terms ranks must agree on (plain, picklable values)."""
    mesh = group.mesh_info.mesh
    key = id(mesh)
    if key not in meshes:  # formatted once per mesh: 1024 ranks are a long string
        names = tuple(mesh.mesh_dim_names or ())
        # Ranks relative to the mesh's first: one check may span ranks whose meshes are
        # different copies of one layout (experts' efsdp [0, 2] and [1, 3]), which agree.
        offsets = [r - mesh.mesh.flatten()[0].item() for r in mesh.mesh.flatten().tolist()]
        spans = offsets == list(range(len(offsets)))
        meshes[key] = (
            f"shape {tuple(mesh.mesh.shape)}" + (f" dims {names}" if names else "")
            + (f" {len(offsets)} consecutive ranks" if spans else f" rank offsets {offsets}")
        )
    pf = group.post_forward_mesh_info
    mp = group.mp_policy
    return {
        "group": group.module_fqn,
        "settings": {
            "mesh": meshes[key],
            "reshard_after_forward": (
                pf.size if pf is not None else group.settings.reshard_after_forward
            ),
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


def _hash(fingerprint: list[dict[str, Any]]) -> str:
    return hashlib.blake2b(repr(fingerprint).encode(), digest_size=16).hexdigest()


def _participants(groups: Sequence[FSDPParamGroup]) -> tuple[int, ...]:
    """The ranks the root's meshes span (a 2-D mesh: rows and columns), sorted."""
    ranks: set[int] = set()
    for mesh in {id(g.mesh_info.mesh): g.mesh_info.mesh for g in groups}.values():
        ranks.update(mesh.mesh.flatten().tolist())
    return tuple(sorted(ranks))


def _next_prefix(ranks: tuple[int, ...]) -> str:
    """This check's keys: the same on every participant, fresh for every check."""
    counts = _CHECKS.setdefault(dist.group.WORLD, {})
    k = counts.get(ranks, 0)
    counts[ranks] = k + 1
    digest = hashlib.blake2b(repr(ranks).encode(), digest_size=6).hexdigest()
    return f"fsdp2/divergence/{len(ranks)}r{digest}/{k}"


def check_same_model(
    root_name: str,
    groups: Sequence[FSDPParamGroup],
    local_error: BaseException | None = None,
) -> None:
    """Raise the same error on every rank if the ranks would shard different models.

    ``groups``: the root's groups in lazy-init order, named (FQNs set).
    ``local_error``: this rank's own lazy-init failure, if any; it is
    re-raised here after the exchange. See [Note: Divergence check at lazy init].
    """
    # Fake tensors hold no data to compare; a fake PG is one process playing every rank.
    skip = fake_tensors_active() or not dist.is_initialized() or dist.get_backend() == "fake"
    ranks = () if skip else _participants(groups)
    if len(ranks) <= 1:
        if local_error is not None:
            raise local_error
        return
    meshes: dict[int, str] = {}
    fingerprint = None if local_error else [group_fingerprint(g, meshes) for g in groups]
    store = dist.PrefixStore(_next_prefix(ranks), default_store())
    verdict = exchange(
        store, dist.get_rank(), ranks,
        digest=None if fingerprint is None else _hash(fingerprint),
        summary=lambda: json.dumps(fingerprint),
        describe=lambda ref, bad, bad_ranks: describe_divergence(
            root_name, ranks[0], json.loads(ref), bad_ranks, json.loads(bad)),
        error=None if local_error is None else f"{type(local_error).__name__}: {local_error}",
        what=f"root '{root_name}'",
    )
    if local_error is not None:
        raise local_error
    if verdict.failed:
        failed = verdict.failed
        raise RuntimeError(
            f"FSDP lazy init of '{root_name}' failed on rank{'s' if len(failed) > 1 else ''} "
            f"{_format_ranks(failed)}, so this rank stops too instead of waiting for it in a "
            f"collective. Rank {failed[0]} raised:\n{verdict.error}"
        )
    if verdict.bad:
        raise ValueError(verdict.message)
    logger.debug("divergence check: %s, %d groups, %d ranks agree", root_name, len(groups),
                 len(ranks))


@dataclass
class Verdict:
    """What every participant of one check learns; the same on all of them."""

    bad: list[int]  # ranks whose hash differs from the reference's
    failed: list[int]  # ranks whose own lazy init failed
    message: str | None = None  # the reference's description of the difference, if any is bad
    error: str | None = None  # the first failed rank's error, read by the ranks that did not fail


def exchange(
    store: Any,
    rank: int,
    ranks: Sequence[int],
    digest: str | None,
    summary: Callable[[], str],
    describe: Callable[[str, str, list[int]], str],
    error: str | None,
    what: str,
) -> Verdict:
    """One check's store protocol, steps 1-4 of [Note: Divergence check at lazy init].

    ``store``: a store private to this check (a ``PrefixStore``); ``ranks``:
    the sorted participants; ``digest``: this rank's hash, ``None`` when its
    lazy init failed with ``error``; ``summary()``: its summary as JSON, asked
    for only on a mismatch; ``describe(reference's summary, first bad rank's
    summary, bad ranks)``: the error message, called on the reference only;
    ``what``: names the check in timeout errors.
    """
    ref, n = ranks[0], len(ranks)

    def get(key: str) -> str:  # a blocking read; a clear error at the store's timeout
        try:
            return store.get(key).decode()
        except RuntimeError as e:  # DistStoreError (timeout), DistNetworkError (store gone)
            raise RuntimeError(_stalled(store, key, ranks, what, e)) from e

    store.append("who", f"{rank},")  # first: a timeout names the ranks that never came
    if rank == ref:
        store.set("ref", digest or _FAILED)
        ref_digest = digest
    else:
        ref_digest = get("ref")
    if error is not None:
        store.append("failed", f"{rank},")
    elif ref_digest not in (digest, _FAILED):
        store.append("bad", f"{rank},")
    if store.add("arrived", 1) == n:  # the last to arrive: everybody's appends are in
        verdict = {key: _read(store, key) for key in ("bad", "failed", "abort")}
        store.set("done", json.dumps(verdict))
    done = json.loads(get("done"))
    if done["abort"]:  # a rank gave up waiting before the last arrived: it raised already
        raise RuntimeError(f"FSDP's check that every rank shards the same model ({what}) was "
                           f"abandoned by another rank:\n{done['abort']}")
    out = Verdict(_parse_ranks(done["bad"]), _parse_ranks(done["failed"]))
    if out.failed and len(out.failed) < n:  # all failed: each raises its own, no reads
        if rank == out.failed[0]:
            store.set("error", error)
        if error is None:
            out.error = get("error")
    elif out.bad:  # one summary crosses the store, then one message: not W summaries
        if rank == out.bad[0]:
            store.set("bad_summary", summary())
        if rank == ref:
            out.message = describe(summary(), get("bad_summary"), out.bad)
            store.set("message", out.message)
        else:
            out.message = get("message")
    if store.add("left", 1) == n:  # everybody has read everything: leave nothing behind
        for key in _KEYS:
            store.delete_key(key)
    return out


def _read(store: Any, key: str) -> str:
    """The value of ``key``, or "" where nobody set it (``get`` would block)."""
    return store.get(key).decode() if store.check([key]) else ""


def _parse_ranks(text: str) -> list[int]:
    return sorted({int(r) for r in text.split(",") if r})


def _format_ranks(ranks: Sequence[int]) -> str:
    """``[1, 2]``; a long list as ranges (``0-7, 16-23``): thousands of ranks may differ."""
    ranks = sorted(ranks)
    if len(ranks) <= 16:
        return str(ranks)
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in runs)


def _stalled(store: Any, key: str, ranks: Sequence[int], what: str, cause: Exception) -> str:
    """The error of a rank whose blocking read failed; left in ``abort`` for the others."""
    try:
        if store.check(["abort"]):  # another rank gave up first: quote it
            return (f"FSDP's check that every rank shards the same model ({what}) was "
                    f"abandoned by another rank:\n{store.get('abort').decode()}")
        arrived = set(_parse_ranks(_read(store, "who")))
    except RuntimeError:  # the store itself is gone
        return (f"FSDP's check that every rank shards the same model ({what}) lost the "
                f"process group's store while waiting for key '{key}': {cause}")
    missing = [r for r in ranks if r not in arrived]
    message = (
        f"FSDP's check that every rank shards the same model ({what}, ranks "
        f"{_format_ranks(ranks)}) waited for store key '{key}' until the store's timeout "
        f"({getattr(store, 'timeout', '?')}): rank{'s' if len(missing) != 1 else ''} "
        f"{_format_ranks(missing)} never reached the first forward through this root (crashed, "
        f"stuck, or running different code or meshes). Store error: {cause}"
    )
    try:
        store.set("abort", message)
    except RuntimeError:
        pass  # the message is raised here anyway
    return message


def describe_divergence(
    root_name: str,
    ref_rank: int,
    ref: list[dict[str, Any]],
    differing: Sequence[int],
    other: list[dict[str, Any]],
) -> str:
    """The error message: the first difference between the reference and the first rank unlike it."""
    where, ours, theirs = _first_difference(ref, other)
    return (
        f"FSDP ranks are about to shard different models under the root '{root_name}': "
        + (f"rank {differing[0]} differs" if len(differing) == 1
           else f"ranks {_format_ranks(differing)} differ")
        + f" from rank {ref_rank} "
        f"(checked at the first forward, before any FSDP collective; the process group is "
        f"still usable).\n"
        f"First difference, {where}:\n"
        f"  rank {ref_rank}: {ours}\n"
        f"  rank {differing[0]}: {theirs}\n"
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
