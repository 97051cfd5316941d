"""``terngrad``: stochastic ternary codes {-1, 0, 1} times one scale per parameter (Wen et al., NeurIPS 2017)."""
from __future__ import annotations

from typing import Annotated

import torch

from gcomp.collectives import AllgatherCommunicator, bitpack, bitpack_device
from gcomp.collectives.chained import ChainedAllreduceCommunicator, ChainedCompressor
from gcomp.compressors import bernoulli, terngrad_device
from gcomp.compressors.quantise import (RankGenerator, RankwiseCtx, RankwiseDecoder, Scratch, SeededState,
                                        per_segment_, rank_and_world, segment_lengths, segment_scales, wire_scale,
                                        work_dtype)
from gcomp.core import ALLGATHER, ALLREDUCE, MAX, SUM, Payload
from gcomp.kernels import on_device
from gcomp.memory import NoMemory
from gcomp.method import Method
from gcomp.params import OneOf, Range
from gcomp.registry import register

_CHUNK_BYTES = 1 << 16  # the table decode converts byte indices this many at a time (a small, reused buffer)
# Times the int32 of 4 codes (one byte each, at most 3), this puts code j at bit 24 + 2 j and nothing else in
# the top byte: code j meets the constant's byte j' at bit 8 j + 24 - 6 j'; the terms below bit 24 sum to less
# than 2^24 (no carry), those past bit 31 wrap away.
_GATHER_CODES = 0x01041040


def pack_codes_(codes: torch.Tensor) -> torch.Tensor:
    """``bitpack.pack(codes, 2)`` of a flat uint8 tensor of values in {0, 1, 2, 3} whose length is a multiple
    of 32 (whole words), overwritten (scratch): one int32 multiply and shift per 4 codes. Little-endian only."""
    lanes = codes.view(torch.int32)
    packed = torch.empty(lanes.numel(), dtype=torch.uint8, device=codes.device)
    return packed.copy_(lanes.mul_(_GATHER_CODES).bitwise_right_shift_(24)).view(torch.int64)


def code_table(device) -> torch.Tensor:
    """``(256, 4)`` fp32: entry ``[v, j]`` is ``t = code - 1`` of the 2-bit field j of the byte v."""
    fields = torch.arange(256, device=device)[:, None].bitwise_right_shift(2 * torch.arange(4, device=device))
    return fields.bitwise_and_(3).sub_(1).to(torch.float32)


def unpack_codes(words: torch.Tensor, n: int, table: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The ``n`` 2-bit fields of ``words`` decoded through ``table`` (``code_table``) into ``out`` (flat, of
    the table's dtype): each byte of the words gives 4 values in one row gather. Little-endian only."""
    source = words.contiguous().view(torch.uint8)
    whole = n // 4
    index = torch.empty(min(_CHUNK_BYTES, whole + 1), dtype=torch.int32, device=words.device)
    for start in range(0, whole, _CHUNK_BYTES):  # a loop over chunks, not entries
        stop = min(start + _CHUNK_BYTES, whole)
        torch.index_select(table, 0, index[:stop - start].copy_(source[start:stop]),
                           out=out[start * 4:stop * 4].view(-1, 4))
    if n > whole * 4:
        last = index[:1].copy_(source[whole:whole + 1])
        out[whole * 4:n].copy_(torch.index_select(table, 0, last)[0, :n - whole * 4])
    return out[:n]


class TernGradCompressor(SeededState, RankwiseDecoder):
    """Ternary codes by all-gather: per parameter one fp32 scale ``s`` (max |g|, or with clipping
    ``min(max |g|, clip * std)``) and per entry ``t`` in {-1, 0, 1} drawn with ``P(t = sign g) = |g| / s``,
    sent as ``t + 1`` in 2-bit fields (``bitpack``, 32 per int64 word): 2 bits per entry plus 32 bits per
    parameter. Unbiased without clipping (``E[s t] = g``); clipping trades a bias on the outliers for a
    smaller scale. ``aggregate`` decodes every rank's codes into the tensor that was compressed (the hook's
    bucket, as an all-reduce would) and returns it; ``decompress`` returns a new tensor. A non-finite entry
    makes its scale non-finite, and so every entry of its parameter on every rank.

    The hit ``t != 0`` is an exact Bernoulli draw from one random byte per entry (``bernoulli.draw_hits``);
    the codes are packed 4 per int32 multiply (``pack_codes_``) and decoded through a byte table (4 values of
    ``t`` per row gather, ``unpack_codes``), then scaled per parameter. On the device path
    (``gcomp.kernels.on_device``) the same wire in a fixed number of whole-bucket operations, the hits drawn one
    uniform per entry (``terngrad_device``). Memory: per bucket layout, one draws
    buffer of the bucket's work-dtype size (the probabilities, also the decode's work space), one fp32 buffer
    of the bucket's size for ``draw_hits``, a byte per entry for the codes, the hits and ``draw_hits``' ties and
    random bytes, and for 16-bit buckets the fp32 entries; nothing of the bucket's size is allocated per step
    but ``decompress``'s result.
    """

    collective = ALLGATHER

    def __init__(self, clip: float = 2.5, seed: int = 0):
        self.clip = clip
        self.random = RankGenerator(seed, "terngrad")
        self.world_size = 1
        self.scratch = Scratch()
        self._bernoulli: dict[str, dict] = {}  # per bucket layout: draw_hits' byte and tie buffers

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
        zeros up to whole 2-bit words. A zero scale gives ``t = 0``; so does an entry whose ``value / scale``
        is NaN (a non-finite entry or scale: its scale decodes it as non-finite anyway).

        The hit ``t != 0`` is an exact Bernoulli draw from one random byte per entry (``bernoulli.draw_hits``
        against ``256 |value| / scale``; the scale divided by 256 is exact)."""
        n, work, device = values.numel(), values.dtype, values.device
        prob = self.work_space(key, n, work, device).view(work)[:n]
        torch.abs(values, out=prob)
        # a zero scale divides by inf instead: 0 / inf = 0, never a hit, so t = 0
        divisors = torch.where(scales > 0, scales / bernoulli.SCALE, torch.inf).to(work)
        per_segment_(prob, divisors, lengths, torch.Tensor.div_)
        hit = self.scratch.get(key, "hit", n, torch.bool, device)
        uniform = self.scratch.get(key, "uniform", n, torch.float32, device)
        work_buffers = self._bernoulli.setdefault(key, {})
        work_buffers["draws"] = uniform
        draw = bernoulli.draw_hits_device if on_device(values) else bernoulli.draw_hits
        draw(hit, prob, self.random(device), work_buffers)
        padded = bitpack.packed_words(n, 2) * 32
        codes = self.scratch.get(key, "codes", padded, torch.uint8, device)
        codes[n:].zero_()
        # t + 1 = (2 * (value > 0) - 1) * hit + 1, in {0, 1, 2} (uint8: -1 is 255, and 255 + 1 wraps to 0)
        torch.gt(values, 0, out=codes[:n].view(torch.bool))
        codes[:n].mul_(2).sub_(1).mul_(hit.view(torch.uint8)).add_(1)
        return codes

    def compress(self, tensor, bucket):
        values = self.work_values(tensor, bucket.key)
        n, lengths = values.numel(), segment_lengths(bucket, values.numel())
        scales = wire_scale(segment_scales(values, lengths, self.clip))
        codes = self.draw_codes(values, scales, lengths, bucket.key)
        words = pack_codes_(codes) if bitpack.little_endian() else bitpack.pack(codes, 2)
        return Payload([scales, words], RankwiseCtx(n, tensor.dtype, lengths, bucket.key, tensor, values))

    def decode(self, gathered, ctx: RankwiseCtx, out: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of ``(code - 1) * scale`` written into ``out``, rank by rank: each rank's codes
        are unpacked into the draws buffer (free after the encode) and scaled straight into the sum."""
        scales, words = gathered  # (world, segments) fp32, (world, words) int64
        work, n = work_dtype(ctx.dtype), ctx.n
        space = self.work_space(ctx.key, n, work, words.device).view(work)
        total = out if out.dtype == work else self.scratch.get(ctx.key, "sum", n, work, out.device)
        if on_device(words):
            index = self.scratch.get(ctx.key, "index", words.shape[1] * 8, torch.int32, words.device)
            terngrad_device.decode_codes(scales, words, n, ctx.lengths, total, space, index)
            return out if total is out else out.copy_(total)
        table = code_table(words.device).to(work) if bitpack.little_endian() else None
        for rank in range(words.shape[0]):  # a loop over ranks, not entries
            target = total if rank == 0 else space[:n]
            if table is not None:  # t = code - 1 straight from the bytes, then times the scale
                per_segment_(unpack_codes(words[rank], n, table, target), scales[rank].to(work), ctx.lengths,
                             torch.Tensor.mul_)
                if rank:
                    total += target
                continue
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
    decode that bucket as NaN all the same. On the device path the lanes are packed and unpacked by
    ``bitpack_device`` (a few operations for any lane width) and scaled in one pass (``terngrad_device``).
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
        return Payload([scales, lanes], RankwiseCtx(n, tensor.dtype, lengths, bucket.key, tensor, values), ops=(MAX, SUM))

    def second_round(self, payload: Payload) -> None:
        """Ternarise: fill the lanes (``payload.tensors[1]``) from the shared scales (``tensors[0]`` after MAX)."""
        ctx, bits = payload.ctx, bitpack.lane_bits(self.world_size)
        codes = self.draw_codes(ctx.values, payload.tensors[0][:-1], ctx.lengths, ctx.key)
        if on_device(codes):
            payload.tensors[1].copy_(bitpack_device.pack(codes[:ctx.n], bits))
            return
        whole = codes if bitpack.packed_words(codes.numel(), bits) == payload.tensors[1].numel() else codes[:ctx.n]
        payload.tensors[1].copy_(bitpack.pack(whole, bits))

    def decompress(self, tensors, ctx: RankwiseCtx):
        """The summed lanes as ``(field - N) * shared scale``, written into the tensor that was compressed (the
        hook's bucket, as an all-reduce would), which it returns."""
        scales, lanes = tensors
        work, n, bits = work_dtype(ctx.dtype), ctx.n, bitpack.lane_bits(self.world_size)
        out = ctx.tensor.reshape(-1)
        total = out if out.dtype == work else self.scratch.get(ctx.key, "sum", n, work, out.device)
        if on_device(lanes):
            terngrad_device.decode_lanes(scales, lanes, n, ctx.lengths, self.world_size, bits, total)
            return (out if total is out else out.copy_(total)).view_as(ctx.tensor)
        space = self.work_space(ctx.key, n, work, lanes.device, bits).view(work)
        fields = bitpack.unpack(lanes, n, bits, dtype=work, out=space).sub_(self.world_size)
        shared = scales[:-1].to(work) + torch.where(scales[-1] > 0, torch.nan, 0.0).to(work)
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
