"""fsdp2 against upstream's ``fully_shard`` through seeded random call sequences.

Each case runs fixed seeds of ``call_sequences.run_sequence`` (the harness:
what a user calls, and what a user can observe compared after every call);
``FSDP2_CALL_SEQUENCES=N`` runs N seeds per case instead (thousands: a
search, not a CI run). A divergence fails with the seed and the calls that
led to it, so it replays. ``test_finds_known_bugs`` puts back bugs fsdp2 once
had (``mutants.py``) and asserts the sequences find each (``FSDP2_CALL_SEQUENCES``
turns that into the search from seed 0).
"""

from __future__ import annotations

import contextlib
import os

import pytest
from _impl import IMPL
from checks import check_case, packed_everywhere

pytestmark = pytest.mark.skipif(IMPL == "torch", reason="compares fsdp2 with upstream itself")

_EXTRA = int(os.environ.get("FSDP2_CALL_SEQUENCES", "0"))
_FIRST = int(os.environ.get("FSDP2_CALL_SEQUENCES_FROM", "0"))


def _seeds(ci: int) -> range:
    return range(_FIRST, _FIRST + (_EXTRA or ci))


def _sequences(ci_seeds: int, packed: bool = False, **options):
    """``packed``: fsdp2's parameter-major groups take the packed plan (``packed_everywhere``)."""
    def case(rank: int, world_size: int) -> None:
        from call_sequences import run_sequence

        found = []
        for seed in _seeds(ci_seeds):
            with packed_everywhere() if packed else contextlib.nullcontext():
                report = run_sequence(seed, rank, world_size, **options)
            if report is not None:
                found.append(report)
                if not _EXTRA:
                    break
        assert not found, "\n\n".join(found[:5]) + f"\n({len(found)} divergent sequences)"

    return case


# (world size, cases): dim-0 groups at W=2 and 3 (uneven and empty shards), parameter-major
# groups at W=2 (bitwise to upstream there; also on the packed plan), the state offloaded to the host and NVMe tiers,
# bf16 mixed precision, gradient accumulation (sync and is_last_backward set before each
# backward), HSDP (2 x 2) at W=4, and parameter-major groups under tensor
# parallelism (dp 2 x tp 2) against upstream's dim-0 ones.
CASES = {
    2: {
        "dim0": _sequences(4),
        "ragged": _sequences(2, ragged=True),
        "packed": _sequences(1, ragged=True, packed=True),
        "host-tier": _sequences(1, tier="host"),
        "nvme-tier": _sequences(1, tier="nvme"),
        "mixed-precision": _sequences(1, setting="mixed_precision"),
        "accumulation": _sequences(1, setting="accumulation"),
    },
    3: {"dim0": _sequences(2)},
    4: {"hsdp": _sequences(1, setting="hsdp"),
        "ragged-tensor-parallel": _sequences(1, ragged=True, setting="tensor_parallel")},
}


@pytest.mark.parametrize(
    "world_size, case", [(w, c) for w, cases in CASES.items() for c in cases]
)
def test_call_sequences_match_upstream(world_size, case, launch_cases):
    """After every call of a random sequence, fsdp2 shows what upstream shows, to the bit."""
    check_case(launch_cases(world_size, CASES[world_size], timeout=600), case)


def _finds(mutant: str, at: int, **options):
    """The sequences find ``mutant``: at seed ``at``, one of the first 30 seeds that do.

    With ``FSDP2_CALL_SEQUENCES=N``, the search itself: seeds 0 to N-1, until one finds it.
    Either way the finding seed must be clean without the bug.
    """

    def case(rank: int, world_size: int) -> None:
        from call_sequences import run_sequence
        from mutants import MUTANTS

        for seed in range(_EXTRA) if _EXTRA else [at]:
            with MUTANTS[mutant]():
                found = run_sequence(seed, rank, world_size, **options)
            if found is not None:  # the same calls without the bug: no divergence
                assert run_sequence(seed, rank, world_size, **options) is None, found
                return
        raise AssertionError(f"the sequences did not find {mutant!r}")

    return case


# (mutant, a seed that finds it, where its bug lives). A search from seed 0 first finds them
# at 10, 11, 28, 8 and 1; the costly one (compiled steps recompiling: 11 s at seed 1 on 2
# cores, 59 s at seed 4) runs the cheapest of its first finding seeds instead: 19 (1, 4, 11,
# 13, 19, 29 find compiled-step-swapped).
KNOWN_BUGS = {
    "new-state-objects": _finds("new-state-objects", 10),
    "nesterov-writes-grads": _finds("nesterov-writes-grads", 11, optimizer="SGD"),
    "fused-tail": _finds("fused-tail", 28, optimizer="Adam"),
    "offloaded-closure": _finds("offloaded-closure", 8, tier="nvme"),
    "compiled-step-swapped": _finds("compiled-step-swapped", 19),
}


@pytest.mark.parametrize("mutant", list(KNOWN_BUGS))
def test_finds_known_bugs(mutant, launch_cases):
    """Each bug fsdp2 once had, put back, is found by a few random sequences."""
    check_case(launch_cases(2, KNOWN_BUGS, key="mutants", timeout=600), mutant)
