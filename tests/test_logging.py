"""Diagnostics as upstream's: debug records and warnings, with upstream's text.

Upstream's hooks write ``FSDP::pre_forward (layers.0)`` and the like at debug
level on ``torch.distributed.fsdp.fully_shard`` (what ``TORCH_LOGS="+fsdp"``
shows), warn there once about ``reshard_after_forward=1``, and warn
(``UserWarning``) when a module's output that needs grad is a view. fsdp2 does
the same, in the same order; each case runs both in one rank and compares.
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.nn as nn
from _impl import fsdp2_only
from _multiproc import run_ranks
from models import cpu_mesh

import fsdp2

LOGGER = "torch.distributed.fsdp.fully_shard"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append((record.levelno, record.getMessage()))


def _recorded(fully_shard, body) -> list[tuple[int, str]]:
    logger, handler = logging.getLogger(LOGGER), _Records()
    level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    try:
        body(fully_shard)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return handler.messages


def _train_step(fully_shard) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=cpu_mesh())
    fully_shard(model, mesh=cpu_mesh())
    model(torch.randn(2, 4)).sum().backward()


def _reshard_to_one(fully_shard) -> None:
    for _ in range(2):  # warned once
        fully_shard(nn.Linear(4, 4), mesh=cpu_mesh(), reshard_after_forward=1)


def _both(rank, world_size):
    from torch._logging import warning_once
    from torch.distributed.fsdp import fully_shard as upstream

    from fsdp2.runtime.common.profiler_ranges import warn_once

    # once per process: forget what the process this rank forked from warned about
    warning_once.cache_clear()
    warn_once.cache_clear()
    for body in (_train_step, _reshard_to_one):
        ours, theirs = _recorded(fsdp2.fully_shard, body), _recorded(upstream, body)
        assert ours == theirs, (body.__name__, ours, theirs)
        assert theirs, body.__name__  # upstream wrote something to compare with
    caught = []
    for shard in (fsdp2.fully_shard, upstream):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            _view_output(shard)
        caught.append([(w.category, str(w.message)) for w in seen if "view" in str(w.message)])
    assert caught[0] == caught[1] and len(caught[1]) == 1, caught


class _Viewing(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x).view(-1)


def _view_output(fully_shard) -> None:
    model = _Viewing()
    fully_shard(model, mesh=cpu_mesh())
    model(torch.randn(2, 4)).sum().backward()


@fsdp2_only
def test_records_as_upstream_on_its_logger():
    """A training step's hook records, the reshard_after_forward=1 warning and the view-output
    warning: upstream's."""
    run_ranks(_both, 2)
