"""Gradient reduce-scatter in fewer bytes: quantized slices by all-to-all, summed at the owner.

[Note: Quantized gradient exchange]
``GradientCommPolicy(payload=...)`` (api.py) changes what a group's gradient
reduce-scatter sends, not what it computes with. The reduce-scatter input
(``W`` slices of ``n`` elements, slice ``r`` for rank ``r``, in the reduce
dtype) is encoded once per element, slice by slice, and exchanged by one
``all_to_all_single``: each rank receives the ``W`` encoded copies of its own
slice, decodes them into the reduce dtype and adds them in rank order (rank
0's first), so the sum is never rounded to the payload and every run at a
given ``W`` gives the same bits. A ring reduce-scatter in the payload dtype
(upstream's ``reduce_dtype=torch.bfloat16``) rounds at every hop instead.

Payloads: ``bfloat16`` (a cast; 2 bytes an element), ``float8_e4m3fn`` /
``float8_e5m2`` and ``int8`` with one float32 scale per block of
``block_size`` elements (1 byte an element plus 4 per block: 0.26x float32's
bytes at 128). A block's scale maps its largest magnitude onto the payload's
largest finite value (int8: 127, values rounded to nearest); blocks restart at
every parameter's edge inside a slice (``segments``), so a scale never spans two
parameters nor two ranks. Codes travel as bytes (gloo has no float8).

Signed zeros survive: a block whose elements are all ``-0.0`` (the fill of a
parameter unused on a rank, [Note: Gradients of parameters used on some
ranks] in reduction.py) gets the scale ``-0.0`` and decodes to ``-0.0``, so
"unused everywhere" still reads as ``None``. A block of zeros of either sign
decodes to zeros, as does a block too small to scale (its largest under 127
or 448 times the smallest float32).

Error feedback (``error_feedback=True``): each rank keeps what its encoding
lost (the input plus the kept residual, minus what it decodes to) and adds it
to the next reduction's input, so the error does not accumulate over steps.
It costs one reduce-dtype buffer of the reduce-scatter input's size per group
(the unsharded gradient's size) for as long as the module lives.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

__all__ = ["QMAX", "QuantizedReduceScatter", "decode", "encode", "wire_bytes"]

# the payload's largest finite magnitude a block's scale maps its largest onto
QMAX: dict[torch.dtype, float] = {
    torch.int8: 127.0,
    torch.float8_e4m3fn: 448.0,
    torch.float8_e5m2: 57344.0,
}


def wire_bytes(numel: int, payload: torch.dtype, block_size: int) -> int:
    """Bytes one slice of ``numel`` elements (one block run) takes on the wire."""
    if payload == torch.bfloat16:
        return 2 * numel
    return numel + 4 * -(-numel // block_size)


@functools.lru_cache(maxsize=256)
def _block_lengths(segments: tuple[int, ...], block_size: int, device: torch.device) -> torch.Tensor:
    """The lengths of the blocks covering ``segments`` (each cut into blocks, the last one short):
    built per parameter, not per block, and kept (a group's segments repeat every step)."""
    parts = []
    for seg in segments:
        full, rest = divmod(seg, block_size)
        if full:
            parts.append(torch.full((full,), block_size, dtype=torch.long))
        if rest:
            parts.append(torch.tensor([rest], dtype=torch.long))
    lengths = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
    return lengths.to(device)


def _block_ids(segments: list[int], block_size: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """Each element's block index, and the number of blocks."""
    lengths = _block_lengths(tuple(segments), block_size, device)
    ids = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)
    return ids, lengths.numel()


def encode(
    values: torch.Tensor, payload: torch.dtype, block_size: int, segments: list[int]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``values`` (1-D) as payload codes and one float32 scale per block (bfloat16: no scales)."""
    if payload == torch.bfloat16:
        return values.to(torch.bfloat16), None
    return _encode(values, payload, *_block_ids(segments, block_size, values.device))


def decode(
    codes: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype, block_size: int,
    segments: list[int],
) -> torch.Tensor:
    """The values ``encode`` gave ``codes`` and ``scales`` for, in ``dtype``."""
    if scales is None:
        return codes.to(dtype)
    return _decode(codes, scales, dtype, _block_ids(segments, block_size, codes.device)[0])


def _encode(
    values: torch.Tensor, payload: torch.dtype, ids: torch.Tensor, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    x = values.float()
    largest = x.new_zeros(count).scatter_reduce_(0, ids, x.abs(), "amax", include_self=False)
    negative = torch.ones(count, dtype=torch.uint8, device=x.device).scatter_reduce_(
        0, ids, torch.signbit(x).to(torch.uint8), "amin", include_self=False
    )
    scales = largest / QMAX[payload]
    zero = scales == 0  # zeros, or denormals too small to scale: sent as zeros
    q = x / torch.where(zero, torch.ones_like(scales), scales)[ids]
    q = torch.where(zero[ids], 0.0, q)  # +0 codes: the scale alone carries the zeros' sign
    # (clamped: a denormal scale is coarse, and its quotients may pass the payload's largest)
    q = q.clamp_(-QMAX[payload], QMAX[payload])
    codes = q.round_().to(torch.int8) if payload == torch.int8 else q.to(payload)
    # a zero block: scale -0.0 where every element is negative, else +0.0; codes 0
    scales = torch.where(zero, torch.where(negative.bool(), -0.0, 0.0), scales)
    return codes, scales


def _decode(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, ids: torch.Tensor) -> torch.Tensor:
    return (codes.float() * scales[ids]).to(dtype)


class QuantizedReduceScatter:
    """One group's reduce-scatter through encoded slices (see [Note: Quantized gradient exchange])."""

    def __init__(self, payload: torch.dtype, block_size: int, error_feedback: bool) -> None:
        self.payload, self.block_size, self.error_feedback = payload, block_size, error_feedback
        self.residual: torch.Tensor | None = None  # error feedback: what the last encoding lost

    def __call__(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup,
        op: object,
        segments: list[list[int]],
    ) -> None:
        """Reduce ``input`` (``W`` slices) into this rank's slice ``output``; ``segments[r]``:
        the parameters' (and gaps') lengths inside slice ``r``."""
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise ValueError(
                f"GradientCommPolicy reduces with SUM or AVG, not {op}: use the default "
                "gradient divide factors (no set_force_sum_reduction_for_comms or NCCL's "
                "pre-multiplied sum with this policy)"
            )
        world = dist.get_world_size(group)
        n = output.numel()
        slices = input.view(world, n)
        if self.error_feedback:
            if self.residual is None or self.residual.shape != slices.shape:
                self.residual = torch.full_like(slices, -0.0)
            slices = slices + self.residual  # (-0.0: x + -0.0 is x, signed zeros included)
        blocks: dict[tuple[int, ...], tuple[torch.Tensor, int]] = {}  # per distinct slice layout

        def ids_of(r: int) -> tuple[torch.Tensor, int]:
            key = tuple(segments[r])
            if key not in blocks:
                blocks[key] = _block_ids(segments[r], self.block_size, input.device)
            return blocks[key]

        def encoded(x: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor | None]:
            if self.payload == torch.bfloat16:
                return x.to(torch.bfloat16), None
            return _encode(x, self.payload, *ids_of(r))

        def decoded(codes: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype, r: int):
            return codes.to(dtype) if scales is None else _decode(codes, scales, dtype, ids_of(r)[0])

        sent = []
        for r in range(world):
            codes, scales = encoded(slices[r], r)
            if self.error_feedback:
                lost = slices[r] - decoded(codes, scales, slices.dtype, r)
                # nothing lost is kept as -0.0, so an unused parameter's -0.0 fill stays -0.0
                self.residual[r].copy_(torch.where(lost == 0, -0.0, lost))
            sent.append((codes, scales))
        me = dist.get_rank(group)
        received = _all_to_all(sent, group, me)
        for r, (codes, scales) in enumerate(received):  # rank order: the same bits every run
            value = decoded(codes, scales, output.dtype, me)
            if r == 0:
                output.copy_(value)
            else:
                output.add_(value)
        if op == dist.ReduceOp.AVG:
            output.div_(world)


def _all_to_all(
    sent: list[tuple[torch.Tensor, torch.Tensor | None]], group: dist.ProcessGroup, me: int
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Every rank's encoded slice ``r`` to rank ``r``, as bytes; what this rank received, by source."""
    def as_bytes(codes: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        parts = [codes.reshape(-1).view(torch.uint8)]
        if scales is not None:
            parts.append(scales.reshape(-1).view(torch.uint8))
        return torch.cat(parts)

    packed = [as_bytes(c, s) for c, s in sent]
    sizes = [p.numel() for p in packed]
    # what rank r sends here is its encoding of this rank's slice: the same layout on
    # every rank (this slice's segments), so each is as long as this rank's own
    incoming = [sizes[me]] * len(packed)
    out = torch.empty(sum(incoming), dtype=torch.uint8, device=packed[0].device)
    dist.all_to_all_single(out, torch.cat(packed), incoming, sizes, group=group)
    codes0, scales0 = sent[me]
    code_bytes = codes0.numel() * codes0.element_size()
    received = []
    for chunk in out.split(incoming):
        codes = chunk[:code_bytes].view(codes0.dtype)
        # (a copy: the scales start at any byte, a float32 view needs 4-byte alignment)
        scales = None if scales0 is None else chunk[code_bytes:].clone().view(torch.float32)
        received.append((codes, scales))
    return received
