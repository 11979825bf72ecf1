"""One root's communication context: FSDP's streams, what is in flight on them, the forward order.

Every group under a root (or under the roots ``share_comm_ctx`` joins) is
handed the same ``CommContext``, as upstream's comm context: it owns the four
streams, the buffers held while a collective on another stream may still use
them (``AllGatherState``, ``ReduceScatterState``), how many reductions may be
in flight (``set_reduce_scatter_max_input_buffers``) and the forward order
that backward prefetching follows. Each ``fully_shard`` call makes one; the
root's lazy init hands the root's to every group below it
(``FSDPParamGroup.set_comm_ctx``, which also hands it to the group's
``GradientReduction``).

[Note: Streams]
On an accelerator the context makes four streams through a stream backend
(``DeviceStreamBackend``: the device-generic ``torch.Stream`` /
``torch.Event`` API, CUDA, ROCm, XPU alike):

- the hooks' all-gathers (a group's own pre-forward / pre-backward and implicit
  or explicit prefetch) run their copy-in (casts, host-to-device moves) on the
  copy-in stream and the collective on the all-gather stream; the compute
  stream waits for the all-gather's event before the copy-out
  (``all_gather->copy_out``);
- the previous group's all-gather output is dropped only after the copy-in
  stream waited for the event recorded after its copy-out
  (``copy_out->compute``): at most one all-gather in flight past the one being
  consumed, as upstream;
- the reduce-scatter stream waits for the compute stream
  (``compute->reduce_scatter``) and runs the ``chunk_cat`` copy-in, the
  collective, the divisions and the sharded-gradient views; HSDP's all-reduce
  runs on the all-reduce stream after it. Up to
  ``set_reduce_scatter_max_input_buffers`` reductions are in flight, each
  holding the gradients its stream reads; before the next one the compute
  stream waits for the oldest until fewer remain (upstream's
  ``FSDP::post_backward_rs_wait``), and the end of backward makes it wait for
  all of them (``reduce_scatter->optimizer``); with CPU offload the host waits
  for the device-to-host copies instead (``offload->optimizer``);
- the next root forward's all-gather streams wait for the post-optimizer
  event, or the compute stream (``post_optim->all_gather``);
- with ``reshard_after_forward`` an int, the backward all-gather streams wait
  for the event recorded after the kept post-forward shard was written on the
  compute stream (``post_forward_shard->all_gather``);
- in the parameter-major layout the all-gather writes the group's one kept
  output, which the compute stream reads and frees: the copy-in stream waits
  for the compute stream before that collective is queued
  (``compute->kept_output``);
- with the optimizer state sharded across replicas and the post-step
  all-gather over replicas left in flight, a group's unshard first makes the
  copy-in stream wait for that collective and copies its output into the
  flat buffer there, before the copy-in reads the buffer
  (``replica_gather->copy_in``; see [Note: Replica slices] in
  replica_slices.py).

Lifetimes cross streams through events and held references, never
``Tensor.record_stream``. On CPU there is one stream: there is no backend,
``active`` is False, every stream method returns at once and the code paths
are the ones without streams; only the count of reductions in flight is kept
(with no buffers held), so the profile shows upstream's ranges.

Every wait goes through the backend with its edge's name (``EDGES``), so a
backend of simulated streams (tests/stream_checker.py) can leave one out and
prove the race it guards is caught.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..common.profiler_ranges import NO_RANGE, record_function

# The named cross-stream waits; see [Note: Streams].
EDGES = (
    "all_gather->copy_out",
    "copy_out->compute",
    "compute->reduce_scatter",
    "reduce_scatter->optimizer",
    "offload->optimizer",
    "post_optim->all_gather",
    "post_forward_shard->all_gather",
    "replica_gather->copy_in",
    "compute->kept_output",
)


class DeviceStreamBackend:
    """Streams and events of an accelerator through torch's device-generic API.

    Each wait is handed its edge's name (one of ``EDGES``, or ``None`` for an
    unnamed one); this backend makes every wait.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._module = torch.get_device_module(device)

    def new_stream(self) -> Any:
        return torch.Stream(device=self.device, priority=-1)

    def current_stream(self) -> Any:
        return self._module.current_stream()

    def use(self, stream: Any) -> Any:
        return self._module.stream(stream)

    def new_event(self) -> Any:
        return torch.Event(device=self.device)

    def wait_stream(self, edge: str | None, waiter: Any, waited: Any) -> None:
        waiter.wait_stream(waited)

    def wait_event(self, edge: str | None, waiter: Any, event: Any) -> None:
        waiter.wait_event(event)

    def synchronize(self, edge: str | None, event: Any) -> None:
        event.synchronize()

    def wait_work(self, edge: str | None, work: Any) -> None:
        work.wait()  # NCCL: the current stream waits for the collective's


def stream_backend_for(device: torch.device) -> DeviceStreamBackend | None:
    """The streams FSDP runs on for ``device``: none on CPU or meta (one stream)."""
    if device.type in ("cpu", "meta"):
        return None
    return DeviceStreamBackend(device)


@dataclass
class AllGatherState:
    """The last hooked all-gather's buffers, held past its copy-out until the next all-gather."""

    buffers: object  # the output and input, or the staged all-gather holding them
    copy_out_event: Any  # recorded on the compute stream after the copy-out


@dataclass
class ReduceScatterState:
    """One reduction in flight: what its streams read, and the event after it."""

    grads: list[torch.Tensor]  # the unsharded gradients (none held on CPU)
    event: Any  # recorded on the reduce-scatter stream; None without streams
    offload: bool  # gradients copied to the host: the host waits, not the compute stream


class CommContext:
    """The streams, in-flight buffers and forward order shared by one root's groups."""

    def __init__(self) -> None:
        self.backend: Any = None  # set at lazy init on an accelerator
        self.copy_in: Any = None
        self.all_gather: Any = None
        self.reduce_scatter: Any = None
        self.all_reduce: Any = None
        self.all_gather_state: AllGatherState | None = None
        self.reduce_scatter_states: deque[ReduceScatterState] = deque()
        # Resolved at the root's lazy init from every group's setting, as upstream.
        self.max_reduce_scatter_inputs = 1
        # Groups in the order their post-forward ran, for backward prefetching.
        self.post_forward_order: list[Any] = []  # the groups (FSDPParamGroup), a layer up

    @property
    def active(self) -> bool:
        """Whether there are FSDP streams (an accelerator); False on CPU."""
        return self.backend is not None

    def init_streams(self, device: torch.device) -> None:
        """Create the streams on first use (lazy init); on CPU there are none."""
        if self.backend is not None:
            return
        backend = stream_backend_for(device)
        if backend is None:
            return
        self.copy_in, self.all_gather = backend.new_stream(), backend.new_stream()
        self.reduce_scatter, self.all_reduce = backend.new_stream(), backend.new_stream()
        self.backend = backend

    # ---- primitives (no-ops when inactive) ------------------------------------

    def current(self) -> Any:
        return self.backend.current_stream()

    def use(self, stream: Any) -> Any:
        """Run the block on ``stream`` (a no-op context when inactive or ``None``)."""
        if not self.active or stream is None:
            return NO_RANGE
        return self.backend.use(stream)

    def record(self, stream: Any = None) -> Any:
        """An event recorded on ``stream`` (default: the current one); ``None`` when inactive."""
        if not self.active:
            return None
        event = self.backend.new_event()
        event.record(stream if stream is not None else self.current())
        return event

    def wait_stream(self, edge: str | None, waiter: Any, waited: Any) -> None:
        if self.active:
            self.backend.wait_stream(edge, waiter, waited)

    def wait_event(self, edge: str | None, waiter: Any, event: Any) -> None:
        if self.active and event is not None:
            self.backend.wait_event(edge, waiter, event)

    def wait_work(self, edge: str | None, work: Any) -> None:
        """The current stream (the host, without streams) waits for an asynchronous collective."""
        if self.active:
            self.backend.wait_work(edge, work)
        else:
            work.wait()

    def synchronize(self, edge: str | None, event: Any) -> None:
        """The host waits for ``event`` (if any)."""
        if event is None:
            return
        if self.active:
            self.backend.synchronize(edge, event)
        else:  # an accelerator's event recorded without FSDP streams
            event.synchronize()

    # ---- all-gathers ---------------------------------------------------------------

    def before_root_forward(self, post_optim_event: Any) -> None:
        """The all-gather streams wait for the optimizer (its event, or the compute stream)."""
        if not self.active:
            return
        if post_optim_event is not None:
            self.wait_all_gather_streams("post_optim->all_gather", post_optim_event)
            return
        for stream in (self.copy_in, self.all_gather):
            self.wait_stream("post_optim->all_gather", stream, self.current())

    def wait_all_gather_streams(self, edge: str, event: Any) -> None:
        """The copy-in and all-gather streams wait for ``event`` (if any)."""
        if self.active and event is not None:
            self.wait_event(edge, self.copy_in, event)
            self.wait_event(edge, self.all_gather, event)

    def hold_all_gather(self, buffers: object) -> None:
        """Keep an all-gather's buffers until the next all-gather, past their copy-out now."""
        self.all_gather_state = AllGatherState(buffers, self.record())

    def release_all_gather(self) -> None:
        """Drop the previous all-gather output once the copy-in stream is past its copy-out."""
        state, self.all_gather_state = self.all_gather_state, None
        if state is not None:
            self.wait_event("copy_out->compute", self.copy_in, state.copy_out_event)

    # ---- reductions ------------------------------------------------------------------

    def make_room_for_reduction(self, fqn: str) -> None:
        """Before a reduction: wait for the oldest in flight until fewer than the cap remain.

        Their gradients go once the compute stream is past their reduce-scatter.
        """
        states = self.reduce_scatter_states
        if len(states) < self.max_reduce_scatter_inputs:
            return
        with record_function("FSDP::post_backward_rs_wait", fqn):
            while len(states) >= self.max_reduce_scatter_inputs:
                oldest = states.popleft()
                if oldest.event is not None:
                    self.wait_event(None, self.current(), oldest.event)

    def hold_reduction(self, grads: list[torch.Tensor], event: Any, offload: bool) -> None:
        """Count a reduction in flight; with streams, hold the gradients its stream reads."""
        held = grads if self.active else []
        self.reduce_scatter_states.append(ReduceScatterState(held, event, offload))

    def after_backward(self) -> None:
        """Before the optimizer: the compute stream (or, for gradients on the host, the
        host) waits for every reduction in flight; their gradients go."""
        states = self.reduce_scatter_states
        while states:
            state = states.popleft()
            if state.event is None:
                continue
            if state.offload:
                self.synchronize("offload->optimizer", state.event)
            else:
                self.wait_event("reduce_scatter->optimizer", self.current(), state.event)

    @contextlib.contextmanager
    def hook_stream(self, stream: Any) -> Iterator[None]:
        """Run ``set_all_reduce_hook``'s hook on its stream, ordered both ways."""
        if not self.active or stream is None:
            yield
            return
        current = self.current()
        self.wait_stream(None, stream, current)
        with self.backend.use(stream):
            yield
        self.wait_stream(None, current, stream)
