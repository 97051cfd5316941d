"""What the stochastic quantisers share: a random stream per rank and its checkpoint, the bucket in its work dtype
cut into parameters, stochastic rounding, a scale's wire form, and fields packed into int64 words."""
from __future__ import annotations

import torch
import torch.distributed as dist

from gcomp.bucket import expand
from gcomp.collectives import bitpack
from gcomp.core import Compressor
from gcomp.randomness import Stream
from gcomp.state_checks import check_state


def rank_and_world(group) -> tuple[int, int]:
    """This rank and the world size of ``group``; (0, 1) outside torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16-bit and fp32 buckets, fp64 for fp64 ones."""
    return torch.promote_types(dtype, torch.float32)


def work_values(x: torch.Tensor, layout) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The flat bucket in its work dtype and its parameters' sizes (one segment where the layout is not its)."""
    n = x.numel()
    lengths = tuple(layout.numels) if layout.numel == n and layout.numels else (n,)
    return x.reshape(-1).to(work_dtype(x.dtype)), lengths


def stochastic_round(z: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``floor(z + u)``, ``u`` uniform on [0, 1): ``floor(z) + 1`` with probability ``frac(z)``, for either sign of
    ``z`` (up to the rounding of ``z + u``, the precision ``z`` itself has). A new tensor."""
    return torch.rand(z.shape, generator=generator, dtype=z.dtype, device=z.device).add_(z).floor_()


def wire_scale(scale: torch.Tensor) -> torch.Tensor:
    """``scale`` as fp32, rounded up where fp32 rounding made it smaller (fp64 buckets), so that
    ``|value| / wire_scale <= 1`` still holds for every entry the scale bounds. NaN stays NaN."""
    wire = scale.to(torch.float32)
    if scale.dtype == torch.float64:
        wire = torch.where(wire.double() < scale, torch.nextafter(wire, torch.full_like(wire, torch.inf)), wire)
    return wire


def scaled_sum(fields: torch.Tensor, offset: int, scales: torch.Tensor, lengths: tuple[int, ...],
               dtype: torch.dtype) -> torch.Tensor:
    """The sum over ranks of ``(field - offset) * scale`` of each entry's parameter, as ``dtype``: ``fields``
    ``(ranks, n)``, ``scales`` ``(ranks, parameters)``."""
    work = work_dtype(dtype)
    units = expand(scales.to(work), lengths, fields.shape[-1])
    return fields.to(work).sub_(offset).mul_(units).sum(0).to(dtype)


def _bytewise(bits: int) -> bool:
    """Whether fields of ``bits`` bits lie inside the words' bytes in field order: packed a byte per field."""
    return 8 % bits == 0 and bitpack.little_endian()


def pack_fields(values: torch.Tensor, bits: int) -> torch.Tensor:
    """``bitpack.pack(values, bits)`` of the flat integer-valued ``values``; fields of 1, 2, 4 or 8 bits shifted
    in a byte each (not bitpack's int64 each)."""
    if not _bytewise(bits):
        return bitpack.pack(values, bits)
    n, per = values.numel(), 8 // bits
    grid = torch.zeros(bitpack.packed_words(n, bits) * 8 * per, dtype=torch.uint8, device=values.device)
    grid[:n] = values
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=values.device)
    return grid.view(-1, per).bitwise_left_shift_(shifts).sum(1, dtype=torch.uint8).view(torch.int64)


def unpack_rows(words: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """The first ``n`` fields of each row of the ``(ranks, W)`` int64 ``words``: ``(ranks, n)`` integers (uint8 for
    fields of 1, 2, 4 or 8 bits)."""
    if not _bytewise(bits):
        return bitpack.unpack(words.reshape(-1), words.numel() * (64 // bits), bits).view(words.shape[0], -1)[:, :n]
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=words.device)
    fields = words.contiguous().view(torch.uint8).view(-1, 1).bitwise_right_shift(shifts)
    return fields.bitwise_and_((1 << bits) - 1).view(words.shape[0], -1)[:, :n]


class StochasticCompressor(Compressor):
    """A codec that draws from a random stream of its own rank (``gcomp.randomness.Stream`` of the method's seed,
    its ``tag`` and the rank given at ``bind``). Its state is ``{"generator": the stream's state}``; a resized run
    starts every rank's stream afresh, and so does a checkpoint of gcomp 0.1 (a generator state per device, or one
    tensor), once checked."""

    def __init__(self, seed: int, tag: str):
        self.stream, self.world = Stream(seed, tag, 0), 1

    def bind(self, model, group, stats) -> None:
        rank, self.world = rank_and_world(group)
        self.stream.bind(rank)

    def state_dict(self) -> dict:
        return {"generator": self.stream.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        check_state(self, state, {"generator": (dict, torch.Tensor)})
        self.stream.load_state_dict(state["generator"])

    def merge_states(self, assigned: list[dict], every: list[dict], rank: int) -> dict:
        return {"generator": {}}
