"""``terngrad``: stochastic ternary codes {-1, 0, 1} times one scale per parameter (Wen et al., NeurIPS 2017)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import torch

from gcomp.collectives import AllgatherCommunicator, bitpack
from gcomp.collectives.chained import ChainedAllreduceCommunicator, ChainedCompressor
from gcomp.compressors.quantise import (RankGenerator, SeededState, per_segment_, rank_and_world, segment_lengths,
                                        segment_scales, wire_scale, work_dtype)
from gcomp.core import ALLGATHER, ALLREDUCE, MAX, SUM, Compressor, Method, Payload
from gcomp.memory import NoMemory
from gcomp.params import OneOf, Range
from gcomp.registry import register

@dataclass
class _Ctx:
    n: int
    dtype: torch.dtype
    lengths: tuple[int, ...]
    values: torch.Tensor | None = None  # the all-reduce path: the entries, ternarised once the scale is shared


class TernGradCompressor(SeededState, Compressor):
    """Ternary codes by all-gather: per parameter one fp32 scale ``s`` (max |g|, or with clipping
    ``min(max |g|, clip * std)``) and per entry ``t`` in {-1, 0, 1} drawn with ``P(t = sign g) = |g| / s``,
    sent as ``t + 1`` in 2-bit fields (``bitpack``, 32 per int64 word): 2 bits per entry plus 32 bits per
    parameter. Unbiased without clipping (``E[s t] = g``); clipping trades a bias on the outliers for a
    smaller scale. ``aggregate`` decodes every rank's codes at once; a non-finite entry makes its scale
    non-finite, and so every entry of its parameter on every rank.
    """

    collective = ALLGATHER

    def __init__(self, clip: float = 2.5, seed: int = 0):
        self.clip = clip
        self.random = RankGenerator(seed, "terngrad")
        self.world_size = 1

    def bind(self, model, group, stats) -> None:
        rank, self.world_size = rank_and_world(group)
        self.random.bind(rank)

    def draw_codes(self, values: torch.Tensor, scales: torch.Tensor, lengths: tuple[int, ...]) -> torch.Tensor:
        """``t + 1`` in {0, 1, 2} as uint8, with ``P(t = sign value) = min(1, |value| / scale)``; an entry whose
        probability is NaN (a non-finite entry or scale, a zero scale) gets ``t = 0``."""
        n = values.numel()
        prob = per_segment_(values.abs(), scales.to(values.dtype), lengths, torch.Tensor.div_).clamp_(max=1.0)
        hit = torch.rand(n, generator=self.random(values.device), dtype=values.dtype, device=values.device) < prob
        return torch.where(hit, torch.where(values > 0, 2, 0), 1).to(torch.uint8)

    def compress(self, tensor, bucket):
        values = tensor.to(work_dtype(tensor.dtype))
        n, lengths = values.numel(), segment_lengths(bucket, values.numel())
        scales = wire_scale(segment_scales(values, lengths, self.clip))
        words = bitpack.pack(self.draw_codes(values, scales, lengths), 2)
        return Payload([scales, words], _Ctx(n, tensor.dtype, lengths))

    def decompress(self, tensors, ctx: _Ctx):
        return self.aggregate([t.unsqueeze(0) for t in tensors], ctx)

    def aggregate(self, gathered, ctx: _Ctx):
        scales, words = gathered  # (world, segments) fp32, (world, words) int64
        world, work = words.shape[0], work_dtype(ctx.dtype)
        codes = bitpack.unpack(words.reshape(-1), words.numel() * 32, 2, dtype=work).view(world, -1)[:, :ctx.n]
        return per_segment_(codes - 1, scales.to(work), ctx.lengths, torch.Tensor.mul_).sum(0).to(ctx.dtype)



class SharedScaleTernGradCompressor(TernGradCompressor, ChainedCompressor):
    """Ternary codes by integer SUM all-reduce, in two chained rounds (``ChainedAllreduceCommunicator``): first
    the fp32 scales per parameter plus one flag slot (MAX, so every rank uses the largest scale), then ``t + 1``
    drawn against that shared scale in ``bitpack.lane_bits(N)``-bit fields of int64 words (SUM: a field sums to
    at most 2N, no carry crosses; 4 bits per entry on 4 ranks, 12 on 1024). Decoded as ``(field - N) * scale``.

    The flag slot is 1 when a rank's scale is non-finite: MAX may drop a NaN, the flag makes every rank
    decode that bucket as NaN all the same.
    """

    collective = ALLREDUCE

    def compress(self, tensor, bucket):
        values = tensor.to(work_dtype(tensor.dtype))
        n, lengths = values.numel(), segment_lengths(bucket, values.numel())
        segments = len(lengths)
        scales = torch.empty(segments + 1, dtype=torch.float32, device=values.device)
        scales[:segments] = wire_scale(segment_scales(values, lengths, self.clip))
        scales[segments] = (~torch.isfinite(scales[:segments])).any()
        bits = bitpack.lane_bits(self.world_size)
        lanes = torch.zeros(bitpack.packed_words(n, bits), dtype=torch.int64, device=values.device)
        return Payload([scales, lanes], _Ctx(n, tensor.dtype, lengths, values), ops=(MAX, SUM))

    def second_round(self, payload: Payload) -> None:
        """Ternarise: fill the lanes (``payload.tensors[1]``) from the shared scales (``tensors[0]`` after MAX)."""
        ctx = payload.ctx
        codes = self.draw_codes(ctx.values, payload.tensors[0][:-1], ctx.lengths)
        payload.tensors[1].copy_(bitpack.pack(codes, bitpack.lane_bits(self.world_size)))

    def decompress(self, tensors, ctx: _Ctx):
        scales, lanes = tensors
        work = work_dtype(ctx.dtype)
        fields = bitpack.unpack(lanes, ctx.n, bitpack.lane_bits(self.world_size), dtype=work).sub_(self.world_size)
        shared = scales[:-1].to(work) + torch.where(scales[-1] > 0, torch.nan, 0.0).to(work)
        return per_segment_(fields, shared, ctx.lengths, torch.Tensor.mul_).to(ctx.dtype)

    def aggregate(self, gathered, ctx):
        raise TypeError("the shared-scale TernGrad codec is summed by all-reduce, not gathered")


@register("terngrad", paper="Wen et al. 2017 (TernGrad, NeurIPS)")
def terngrad(
    clip: Annotated[float, Range(0, None), "clip at clip * std per parameter (TernGrad: 2.5; 0 off, unbiased)"] = 2.5,
    collective: Annotated[str, OneOf(ALLGATHER, ALLREDUCE),
                          "allgather: 2-bit codes and own scales; allreduce: shared MAX scale, integer lanes"
                          ] = ALLGATHER,
    seed: Annotated[int, Range(0, None), "seed of the draws (each rank draws its own stream from it)"] = 0,
) -> Method:
    """TernGrad: each entry becomes -s, 0 or +s at random, s one scale per parameter (unbiased unless clipped)."""
    if collective == ALLREDUCE:
        return Method(SharedScaleTernGradCompressor(clip, seed), NoMemory(), ChainedAllreduceCommunicator())
    return Method(TernGradCompressor(clip, seed), NoMemory(), AllgatherCommunicator())
