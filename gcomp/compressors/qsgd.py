"""``qsgd``: stochastic rounding onto ``s`` levels of each parameter's L2 norm (Alistarh et al., NeurIPS 2017)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import torch

from gcomp.collectives import AllgatherCommunicator, bitpack
from gcomp.compressors.quantise import (RankGenerator, SeededState, per_segment_, rank_and_world, segment_lengths,
                                        wire_scale, work_dtype)
from gcomp.core import ALLGATHER, Compressor, Method, Payload
from gcomp.memory import NoMemory
from gcomp.params import Range
from gcomp.registry import register

MAX_LEVELS = 2**15 - 1  # 16-bit fields at most


def field_bits(levels: int) -> int:
    """Bits of one entry: the signed level ``l`` in [-s, s] is sent as ``l + s`` in [0, 2s], which takes
    ``ceil(log2(2s + 1))`` bits, the same as one sign bit plus ``ceil(log2(s + 1))`` level bits."""
    return (2 * levels).bit_length()


@dataclass
class _Ctx:
    n: int
    dtype: torch.dtype
    lengths: tuple[int, ...]


class QSGDCompressor(SeededState, Compressor):
    """QSGD by all-gather: per parameter its fp32 L2 norm ``r``, per entry a level ``l`` in {0..s} with
    ``E[l] = s |g| / r`` (rounded down or up at random), sent with the sign as ``sign(g) l + s`` in
    ``field_bits(s)``-bit fields (``bitpack``: 8 bits per entry for the default s = 127, byte-aligned) plus 32
    bits per parameter. Decoded as ``r sign(g) l / s``: unbiased. A non-finite entry makes its norm
    non-finite, and so every entry of its parameter on every rank.
    """

    collective = ALLGATHER

    def __init__(self, levels: int = 127, seed: int = 0):
        self.levels, self.bits = levels, field_bits(levels)
        self.random = RankGenerator(seed, "qsgd")

    def bind(self, model, group, stats) -> None:
        self.random.bind(rank_and_world(group)[0])

    def local_norms(self, values: torch.Tensor, lengths: tuple[int, ...]) -> torch.Tensor:
        norms = torch.zeros(len(lengths), dtype=values.dtype, device=values.device)
        start = 0
        for j, n in enumerate(lengths):  # a loop over parameters, not entries
            if n:
                torch.linalg.vector_norm(values[start:start + n], out=norms[j])
                start += n
        return norms

    def compress(self, tensor, bucket):
        values = tensor.to(work_dtype(tensor.dtype))
        n, lengths = values.numel(), segment_lengths(bucket, values.numel())
        norms = wire_scale(self.local_norms(values, lengths))
        s = self.levels
        # |g| / r * s in [0, s]; 0 / 0 (a zero parameter) and a non-finite norm give NaN, sent as level 0
        scaled = per_segment_(values.abs(), norms.to(values.dtype), lengths, torch.Tensor.div_).mul_(s)
        level = scaled.floor()
        draws = torch.rand(n, generator=self.random(values.device), dtype=values.dtype, device=values.device)
        level += draws < scaled.sub_(level)  # up with probability equal to the fractional part
        level = level.nan_to_num_(nan=0.0).clamp_(0, s)
        fields = torch.where(values < 0, -level, level).add_(s).to(torch.int32)
        return Payload([norms, bitpack.pack(fields, self.bits)], _Ctx(n, tensor.dtype, lengths))

    def decompress(self, tensors, ctx: _Ctx):
        return self.aggregate([t.unsqueeze(0) for t in tensors], ctx)

    def aggregate(self, gathered, ctx: _Ctx):
        norms, words = gathered  # (world, segments) fp32, (world, words) int64
        world, work = words.shape[0], work_dtype(ctx.dtype)
        per_word = bitpack.fields_per_word(self.bits)
        fields = bitpack.unpack(words.reshape(-1), words.numel() * per_word, self.bits, dtype=work)
        levels = fields.view(world, -1)[:, :ctx.n].sub_(self.levels)
        unit = norms.to(work) / self.levels  # not in place: .to may return the payload tensor itself
        return per_segment_(levels, unit, ctx.lengths, torch.Tensor.mul_).sum(0).to(ctx.dtype)



@register("qsgd", paper="Alistarh, Grubic, Li, Tomioka, Vojnovic 2017 (QSGD, NeurIPS)")
def qsgd(
    levels: Annotated[int, Range(1, MAX_LEVELS), "quantisation levels s per sign (bits per entry: log2(2s+1) up)"
                      ] = 127,
    seed: Annotated[int, Range(0, None), "seed of the draws (each rank draws its own stream from it)"] = 0,
) -> Method:
    """QSGD: entries rounded at random onto s levels of their parameter's L2 norm (unbiased), by all-gather."""
    return Method(QSGDCompressor(levels, seed), NoMemory(), AllgatherCommunicator())
