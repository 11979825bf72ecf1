"""FSDP's own streams: copy-in, all-gather, reduce-scatter and all-reduce, per root.

[Note: Streams]
On an accelerator each root (or roots joined by ``share_comm_ctx``) owns a
``CommStreams``: four streams made through the device-generic ``torch.Stream``
/ ``torch.Event`` API (CUDA, ROCm, XPU alike), as upstream's comm context:

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
  runs on the all-reduce stream after it. The next reduce-scatter waits for
  the previous one's event first (one in flight), and the end of backward
  makes the compute stream wait for the last (``reduce_scatter->optimizer``);
  with CPU offload the host waits for the device-to-host copies instead
  (``offload->optimizer``);
- the next root forward's all-gather streams wait for the post-optimizer
  event, or the compute stream (``post_optim->all_gather``);
- with ``reshard_after_forward`` an int, the backward all-gather streams wait
  for the event recorded after the kept post-forward shard was written on the
  compute stream (``post_forward_shard->all_gather``).

Lifetimes cross streams through events and held references, never
``Tensor.record_stream``. On CPU there is one stream: ``CommStreams.active``
is False, every method returns at once and the code paths are today's.

Tests swap in simulated streams (``_set_backend``) and may skip one named
wait (``_SKIPPED_EDGES``) to prove the stream-order checker
(tests/stream_checker.py) catches the race.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from .._torch_compat import profiler_enabled

# Test hooks: a backend for CPU tensors (simulated streams), and waits to skip.
_backend_override: Any = None
_SKIPPED_EDGES: set[str] = set()

EDGES = (
    "all_gather->copy_out",
    "copy_out->compute",
    "compute->reduce_scatter",
    "reduce_scatter->optimizer",
    "offload->optimizer",
    "post_optim->all_gather",
    "post_forward_shard->all_gather",
)


def _set_backend(backend: Any) -> Any:
    """Tests only: streams for CPU tensors (``None``: none); returns the previous."""
    global _backend_override
    previous, _backend_override = _backend_override, backend
    return previous


class _DeviceBackend:
    """Streams and events of an accelerator through torch's device-generic API."""

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


def _backend_for(device: torch.device) -> Any:
    if _backend_override is not None:
        return _backend_override
    if device.type in ("cpu", "meta"):
        return None
    return _DeviceBackend(device)


class CommStreams:
    """One root's FSDP streams and the state that bounds what the CPU may run ahead with."""

    def __init__(self) -> None:
        self.active = False
        self._backend: Any = None
        self.copy_in: Any = None
        self.all_gather: Any = None
        self.reduce_scatter: Any = None
        self.all_reduce: Any = None
        # (all-gather output held, event after its copy-out): dropped by the next all-gather
        self.all_gather_state: tuple[Any, Any] | None = None
        # (reduce-scatter buffers held, event after the reduction): waited by the next one
        self.reduce_scatter_state: tuple[Any, Any] | None = None
        self.reduce_scatter_offload = False  # the last reduction copied gradients to the host

    def init(self, device: torch.device) -> None:
        """Create the streams on first use (lazy init); on CPU there are none."""
        if self._backend is not None or self.active:
            return
        backend = _backend_for(device)
        if backend is None:
            return
        self._backend = backend
        self.copy_in, self.all_gather = backend.new_stream(), backend.new_stream()
        self.reduce_scatter, self.all_reduce = backend.new_stream(), backend.new_stream()
        self.active = True

    # ---- primitives (no-ops when inactive) ------------------------------------

    def current(self) -> Any:
        return self._backend.current_stream()

    def use(self, stream: Any) -> Any:
        """Run the block on ``stream`` (a no-op context when inactive or ``None``)."""
        if not self.active or stream is None:
            return _NO_RANGE
        return self._backend.use(stream)

    def record(self, stream: Any = None) -> Any:
        """An event recorded on ``stream`` (default: the current one); ``None`` when inactive."""
        if not self.active:
            return None
        event = self._backend.new_event()
        event.record(stream if stream is not None else self.current())
        return event

    def wait_stream(self, edge: str | None, waiter: Any, waited: Any) -> None:
        if self.active and edge not in _SKIPPED_EDGES:
            waiter.wait_stream(waited)

    def wait_event(self, edge: str | None, waiter: Any, event: Any) -> None:
        if self.active and event is not None and edge not in _SKIPPED_EDGES:
            waiter.wait_event(event)

    # ---- the orderings of one step ------------------------------------------------

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

    def release_all_gather(self) -> None:
        """Drop the previous all-gather output once the copy-in stream is past its copy-out."""
        state, self.all_gather_state = self.all_gather_state, None
        if state is not None:
            self.wait_event("copy_out->compute", self.copy_in, state[1])

    def release_reduce_scatter(self, fqn: str = "") -> None:
        """The compute stream waits for the previous reduce-scatter, then its buffers go."""
        state, self.reduce_scatter_state = self.reduce_scatter_state, None
        if state is not None:
            with record_function("FSDP::post_backward_rs_wait", fqn):
                self.wait_event(None, self.current(), state[1])

    def after_backward(self) -> None:
        """Before the optimizer: the compute stream (or, for gradients on the host, the
        host) waits for the last reduction."""
        state, self.reduce_scatter_state = self.reduce_scatter_state, None
        if state is None:
            return
        if not self.reduce_scatter_offload:
            self.wait_event("reduce_scatter->optimizer", self.current(), state[1])
        elif "offload->optimizer" not in _SKIPPED_EDGES:
            state[1].synchronize()

    @contextlib.contextmanager
    def hook_stream(self, stream: Any) -> Iterator[None]:
        """Run ``set_all_reduce_hook``'s hook on its stream, ordered both ways."""
        if not self.active or stream is None:
            yield
            return
        current = self.current()
        stream.wait_stream(current)
        with self._backend.use(stream):
            yield
        current.wait_stream(stream)


def record_function(name: str, fqn: str = "", when: bool = True) -> Any:
    """A profiler range named as upstream's (``FSDP::pre_forward (layers.0)``), if ``when``.

    Free when no profiler runs: the label is only built while one does, and
    the no-op context is one shared object.
    """
    if when and profiler_enabled():
        if fqn:  # upstream names a prefetch "for" its target
            name = f"{name} for {fqn}" if name.endswith("_prefetch") else f"{name} ({fqn})"
        return torch.profiler.record_function(name)
    return _NO_RANGE


_NO_RANGE = contextlib.nullcontext()  # reusable: it holds no state
