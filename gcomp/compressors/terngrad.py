"""``terngrad``: stochastic ternary codes {-1, 0, 1} times one scale per parameter (Wen et al., NeurIPS 2017)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import torch

from gcomp.collectives import AllgatherCommunicator, bitpack
from gcomp.collectives.chained import ChainedAllreduceCommunicator, ChainedCompressor
from gcomp.compressors.quantise import (RankGenerator, Scratch, SeededState, add_scaled_, draw_units,
                                        rank_and_world, segment_lengths, segment_scales, wire_scale, work_dtype)
from gcomp.core import ALLGATHER, ALLREDUCE, MAX, SUM, Compressor, Method, Payload
from gcomp.memory import NoMemory
from gcomp.params import OneOf, Range
from gcomp.registry import register

@dataclass
class _Ctx:
    n: int
    dtype: torch.dtype
    lengths: tuple[int, ...]
    key: str  # the bucket layout: its scratch buffers
    tensor: torch.Tensor  # what was compressed: ``aggregate`` (the hook's decode) writes the result into it
    values: torch.Tensor  # the entries in the work dtype (``tensor`` itself for fp32 and fp64 buckets)


class TernGradCompressor(SeededState, Compressor):
    """Ternary codes by all-gather: per parameter one fp32 scale ``s`` (max |g|, or with clipping
    ``min(max |g|, clip * std)``) and per entry ``t`` in {-1, 0, 1} drawn with ``P(t = sign g) = |g| / s``,
    sent as ``t + 1`` in 2-bit fields (``bitpack``, 32 per int64 word): 2 bits per entry plus 32 bits per
    parameter. Unbiased without clipping (``E[s t] = g``); clipping trades a bias on the outliers for a
    smaller scale. ``aggregate`` decodes every rank's codes into the tensor that was compressed (the hook's
    bucket, as an all-reduce would) and returns it; ``decompress`` returns a new tensor. A non-finite entry
    makes its scale non-finite, and so every entry of its parameter on every rank.

    The draw is ``t + 1 = floor(g / s + w)`` with ``w`` uniform on [1, 2) (``quantise.add_scaled_``), clamped
    to {0, 1, 2} where clipping puts ``|g| / s`` past 1. Memory: per bucket layout, one draws buffer of the
    bucket's fp32 size (also the decode's work space), one of a byte per entry for the codes, and for 16-bit
    buckets the fp32 entries; nothing of the bucket's size is allocated per step but ``decompress``'s result.
    """

    collective = ALLGATHER

    def __init__(self, clip: float = 2.5, seed: int = 0):
        self.clip = clip
        self.random = RankGenerator(seed, "terngrad")
        self.world_size = 1
        self.scratch = Scratch()

    def bind(self, model, group, stats) -> None:
        rank, self.world_size = rank_and_world(group)
        self.random.bind(rank)

    def work_values(self, tensor: torch.Tensor, key: str) -> torch.Tensor:
        """The bucket in the work dtype: itself for fp32 and fp64, else widened into a kept fp32 buffer."""
        work = work_dtype(tensor.dtype)
        if tensor.dtype == work:
            return tensor.reshape(-1)
        return self.scratch.get(key, "values", tensor.numel(), work, tensor.device).copy_(tensor.reshape(-1))

    def work_space(self, key: str, n: int, work: torch.dtype, device, bits: int = 2) -> torch.Tensor:
        """The draws buffer (int64 words): ``n`` draws of ``work``'s width, and at least as many ``work``
        entries as ``n`` fields of 2 or ``bits`` bits padded to whole words (the decode unpacks into it)."""
        per_word = 2 if work == torch.float32 else 1  # work entries per int64 word
        fields = max(n, bitpack.packed_words(n, 2) * 32, bitpack.packed_words(n, bits) * bitpack.fields_per_word(bits))
        return self.scratch.get(key, "draws", -(-fields // per_word), torch.int64, device)

    def draw_codes(self, values: torch.Tensor, scales: torch.Tensor, lengths: tuple[int, ...],
                   key: str = "") -> torch.Tensor:
        """``t + 1`` in {0, 1, 2} as uint8, with ``P(t = sign value) = min(1, |value| / scale)``, followed by
        zeros up to whole 2-bit words. A zero scale gives ``t = 0``; an entry whose ``value / scale`` is NaN (a
        non-finite entry or scale) gets some code in {0, 1, 2}: its scale decodes it as non-finite anyway."""
        n, work, device = values.numel(), values.dtype, values.device
        draws = draw_units(self.work_space(key, n, work, device), n, work, self.random(device))
        # a zero scale divides by inf instead: 0 / inf = 0, so t = 0 (the scale decodes every code to 0)
        divisors = torch.where(scales > 0, scales, torch.inf).to(work)
        add_scaled_(draws, values, divisors, lengths, divide=True).clamp_(0.0, 2.0)  # floor(g / s + w)
        padded = bitpack.packed_words(n, 2) * 32
        codes = self.scratch.get(key, "codes", padded, torch.uint8, device)
        codes[n:].zero_()
        codes[:n].copy_(draws)  # truncation: the floor of values in [0, 2]
        return codes.clamp_(max=2)  # NaN converts to an undefined byte: keep the neighbours' fields intact

    def compress(self, tensor, bucket):
        values = self.work_values(tensor, bucket.key)
        n, lengths = values.numel(), segment_lengths(bucket, values.numel())
        scales = wire_scale(segment_scales(values, lengths, self.clip))
        words = bitpack.pack(self.draw_codes(values, scales, lengths, bucket.key), 2)
        return Payload([scales, words], _Ctx(n, tensor.dtype, lengths, bucket.key, tensor, values))

    def decompress(self, tensors, ctx: _Ctx):
        out = torch.empty(ctx.n, dtype=ctx.dtype, device=tensors[0].device)
        return self.decode([t.unsqueeze(0) for t in tensors], ctx, out)

    def aggregate(self, gathered, ctx: _Ctx):
        return self.decode(gathered, ctx, ctx.tensor.reshape(-1)).view_as(ctx.tensor)

    def decode(self, gathered, ctx: _Ctx, out: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of ``(code - 1) * scale`` written into ``out``, rank by rank: each rank's codes
        are unpacked into the draws buffer (free after the encode) and scaled straight into the sum."""
        scales, words = gathered  # (world, segments) fp32, (world, words) int64
        work, n = work_dtype(ctx.dtype), ctx.n
        space = self.work_space(ctx.key, n, work, words.device).view(work)
        total = out if out.dtype == work else self.scratch.get(ctx.key, "sum", n, work, out.device)
        for rank in range(words.shape[0]):  # a loop over ranks, not entries
            codes = bitpack.unpack(words[rank], n, 2, dtype=work, out=space)
            scale = scales[rank].to(work)
            target = total if rank == 0 else codes
            for c, t, s, m in zip(torch.split(codes, ctx.lengths), torch.split(target, ctx.lengths),
                                  scale.unbind(-1), (-scale).unbind(-1)):
                if c.numel():
                    torch.addcmul(m, c, s, out=t)  # (code - 1) * s, exact for code in {0, 1, 2}
            if rank:
                total += codes
        return out if total is out else out.copy_(total)


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
        values = self.work_values(tensor, bucket.key)
        n, lengths = values.numel(), segment_lengths(bucket, values.numel())
        segments = len(lengths)
        scales = torch.empty(segments + 1, dtype=torch.float32, device=values.device)
        scales[:segments] = wire_scale(segment_scales(values, lengths, self.clip))
        scales[segments] = (~torch.isfinite(scales[:segments])).any()
        bits = bitpack.lane_bits(self.world_size)
        lanes = torch.zeros(bitpack.packed_words(n, bits), dtype=torch.int64, device=values.device)
        return Payload([scales, lanes], _Ctx(n, tensor.dtype, lengths, bucket.key, tensor, values), ops=(MAX, SUM))

    def second_round(self, payload: Payload) -> None:
        """Ternarise: fill the lanes (``payload.tensors[1]``) from the shared scales (``tensors[0]`` after MAX)."""
        ctx, bits = payload.ctx, bitpack.lane_bits(self.world_size)
        codes = self.draw_codes(ctx.values, payload.tensors[0][:-1], ctx.lengths, ctx.key)
        whole = codes if bitpack.packed_words(codes.numel(), bits) == payload.tensors[1].numel() else codes[:ctx.n]
        payload.tensors[1].copy_(bitpack.pack(whole, bits))

    def decompress(self, tensors, ctx: _Ctx):
        """The summed lanes as ``(field - N) * shared scale``, written into the tensor that was compressed (the
        hook's bucket, as an all-reduce would), which it returns."""
        scales, lanes = tensors
        work, n, bits = work_dtype(ctx.dtype), ctx.n, bitpack.lane_bits(self.world_size)
        space = self.work_space(ctx.key, n, work, lanes.device, bits).view(work)
        fields = bitpack.unpack(lanes, n, bits, dtype=work, out=space).sub_(self.world_size)
        shared = scales[:-1].to(work) + torch.where(scales[-1] > 0, torch.nan, 0.0).to(work)
        out = ctx.tensor.reshape(-1)
        total = out if out.dtype == work else self.scratch.get(ctx.key, "sum", n, work, out.device)
        for f, t, s in zip(torch.split(fields, ctx.lengths), torch.split(total, ctx.lengths), shared.unbind(-1)):
            if f.numel():
                torch.mul(f, s, out=t)
        return (out if total is out else out.copy_(total)).view_as(ctx.tensor)

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
