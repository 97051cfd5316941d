"""``qsgd``: stochastic rounding onto ``s`` levels of each parameter's L2 norm (Alistarh et al., NeurIPS 2017)."""
from __future__ import annotations

import sys
from typing import Annotated

import torch

from gcomp.collectives import AllgatherCommunicator, bitpack, bitpack_device
from gcomp.compressors import qsgd_device
from gcomp.compressors.quantise import (RankGenerator, RankwiseCtx, RankwiseDecoder, Scratch, SeededState,
                                        add_scaled_, draw_units, per_segment_, rank_and_world, segment_lengths,
                                        wire_scale, work_dtype)
from gcomp.core import ALLGATHER, Payload
from gcomp.kernels import on_device
from gcomp.memory import NoMemory
from gcomp.method import Method
from gcomp.params import Range
from gcomp.registry import register

MAX_LEVELS = 2**15 - 1  # 16-bit fields at most


def field_bits(levels: int) -> int:
    """Bits of one entry: the signed level ``l`` in [-s, s] is sent as ``l + s`` in [0, 2s], which takes
    ``ceil(log2(2s + 1))`` bits, the same as one sign bit plus ``ceil(log2(s + 1))`` level bits."""
    return (2 * levels).bit_length()


# 8-bit fields (s in 64..127, the default 127) are the bytes of the int64 words on a little-endian machine:
# the levels are converted straight into the payload, with no packing pass.
_BYTE_WORDS = sys.byteorder == "little"


class QSGDCompressor(SeededState, RankwiseDecoder):
    """QSGD by all-gather: per parameter its fp32 L2 norm ``r``, per entry a level ``l`` in {0..s} with
    ``E[l] = s |g| / r`` (rounded down or up at random), sent with the sign as ``sign(g) l + s`` in
    ``field_bits(s)``-bit fields (``bitpack``: 8 bits per entry for the default s = 127, byte-aligned) plus 32
    bits per parameter. Decoded as ``r sign(g) l / s``: unbiased. ``aggregate`` decodes every rank's fields
    into the tensor that was compressed (the hook's bucket, as an all-reduce would) and returns it;
    ``decompress`` returns a new tensor. A non-finite entry makes its norm non-finite, and so every entry of
    its parameter on every rank.

    The signed level is drawn in one add: ``sign(g) l = floor(s g / r + w) - 1`` with ``w`` uniform on [1, 2)
    (``quantise.add_scaled_``), which rounds ``s |g| / r`` up with probability equal to its fractional part
    for either sign. On the device path (``gcomp.kernels.on_device``) the same wire and draws in a fixed number
    of whole-bucket operations (``qsgd_device``). Memory: per bucket layout, one draws buffer of the bucket's
    fp32 size (also the decode's work space) and for 16-bit buckets the fp32 entries; nothing of the bucket's
    size is allocated per step but ``decompress``'s result.
    """

    collective = ALLGATHER

    def __init__(self, levels: int = 127, seed: int = 0):
        self.levels, self.bits = levels, field_bits(levels)
        self.random = RankGenerator(seed, "qsgd")
        self.scratch = Scratch()

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

    def work_space(self, key: str, n: int, work: torch.dtype, device) -> torch.Tensor:
        """The draws buffer (int64 words): ``n`` draws of ``work``'s width, and at least as many ``work``
        entries as the fields of ``n`` levels padded to whole words (the decode unpacks into it)."""
        per_word = 2 if work == torch.float32 else 1
        fields = max(n, bitpack.packed_words(n, self.bits) * bitpack.fields_per_word(self.bits))
        return self.scratch.get(key, "draws", -(-fields // per_word), torch.int64, device)

    def compress(self, tensor, bucket):
        work = work_dtype(tensor.dtype)
        values = tensor.reshape(-1) if tensor.dtype == work else \
            self.scratch.get(bucket.key, "values", tensor.numel(), work, tensor.device).copy_(tensor.reshape(-1))
        n, lengths, s = values.numel(), segment_lengths(bucket, values.numel()), self.levels
        space, device = self.work_space(bucket.key, n, work, values.device), on_device(values)
        if device:
            norms, levels = qsgd_device.signed_levels(values, lengths, s, space, self.random(values.device))
        else:
            norms = wire_scale(self.local_norms(values, lengths))
            # a zero parameter (0 / 0) scales by 0 instead: level 0; so does a non-finite norm (its decode is NaN)
            factors = torch.where(norms > 0, s / norms, 0.0).to(work)
            draws = draw_units(space, n, work, self.random(values.device))
            levels = add_scaled_(draws, values, factors, lengths).floor_()  # sign(g) l + 1
        levels.clamp_(1 - s, 1 + s).add_(s - 1)  # the field l + s in [0, 2s] (NaN for a non-finite entry)
        words = bitpack.packed_words(n, self.bits)
        if self.bits == 8 and _BYTE_WORDS:
            fields = torch.empty(words * 8, dtype=torch.uint8, device=values.device)
            fields[n:].zero_()
        else:
            fields = torch.empty(n, dtype=torch.uint8 if 2 * s < 256 else torch.int32, device=values.device)
        fields[:n].copy_(levels)
        fields.clamp_(0, 2 * s)  # NaN converts to an undefined integer: keep the neighbours' fields intact
        # 8-bit fields are the words' own bytes; narrower ones are packed (a bucket of 8 entries has as many
        # bytes as its one word too: the field width decides, not the length)
        if self.bits == 8 and _BYTE_WORDS:
            packed = fields.view(torch.int64)
        else:
            packed = bitpack_device.pack(fields, self.bits) if device else bitpack.pack(fields, self.bits)
        return Payload([norms, packed], RankwiseCtx(n, tensor.dtype, lengths, bucket.key, tensor))

    def decode(self, gathered, ctx: RankwiseCtx, out: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of ``(field - s) * r / s`` written into ``out``, rank by rank: each rank's fields
        (the payload's own bytes for 8-bit fields, else unpacked into the draws buffer) turn into values in
        one pass per segment."""
        norms, words = gathered  # (world, segments) fp32, (world, words) int64
        work, n, s = work_dtype(ctx.dtype), ctx.n, self.levels
        total = out if out.dtype == work else self.scratch.get(ctx.key, "sum", n, work, out.device)
        space = self.work_space(ctx.key, n, work, words.device).view(work)
        if on_device(words):
            qsgd_device.decode(norms, words, n, ctx.lengths, s, self.bits, _BYTE_WORDS, total, space)
            return out if total is out else out.copy_(total)
        for rank in range(words.shape[0]):  # a loop over ranks, not entries
            if self.bits == 8 and _BYTE_WORDS:
                fields = words[rank].view(torch.uint8)[:n]
            else:
                fields = bitpack.unpack(words[rank], n, self.bits, dtype=work, out=space)
            target = total if rank == 0 else space[:n]
            if fields.data_ptr() != target.data_ptr():
                target.copy_(fields)  # a plain conversion: arithmetic across dtypes is several times slower
            target.sub_(s)  # the signed level, exact in the work dtype
            per_segment_(target, norms[rank].to(work) / s, ctx.lengths, torch.Tensor.mul_)
            if rank:
                total += target
        return out if total is out else out.copy_(total)


@register("qsgd", paper="Alistarh, Grubic, Li, Tomioka, Vojnovic 2017 (QSGD, NeurIPS)")
def qsgd(
    levels: Annotated[int, Range(1, MAX_LEVELS), "quantisation levels s per sign (bits per entry: log2(2s+1) up)"
                      ] = 127,
    seed: Annotated[int, Range(0, None), "seed of the draws (each rank draws its own stream from it)"] = 0,
) -> Method:
    """QSGD: entries rounded at random onto s levels of their parameter's L2 norm (unbiased), by all-gather."""
    return Method(QSGDCompressor(levels, seed), NoMemory(), AllgatherCommunicator())
