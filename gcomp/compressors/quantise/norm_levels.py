"""QSGD's codec: stochastic rounding onto ``s`` levels of each parameter's L2 norm."""
from __future__ import annotations

import torch

from gcomp.bucket import expand, segment_reduce
from gcomp.collectives import bitpack
from gcomp.compressors.quantise.rounding import (StochasticCompressor, pack_fields, scaled_sum, stochastic_round,
                                                 unpack_rows, wire_scale, work_dtype, work_values)
from gcomp.core import ALLGATHER, UNBIASED, Keeps, Payload, Traits

MAX_LEVELS = 2**15 - 1  # 16-bit fields at most


def field_bits(levels: int) -> int:
    """Bits of one entry: the signed level ``l`` in [-s, s] is sent as ``l + s`` in [0, 2s], which takes
    ``ceil(log2(2s + 1))`` bits, the same as one sign bit plus ``ceil(log2(s + 1))`` level bits."""
    return (2 * levels).bit_length()


class QSGDCompressor(StochasticCompressor):
    """QSGD by all-gather: per parameter its fp32 L2 norm ``r``, per entry a level ``l`` in {0..s} with
    ``E[l] = s |g| / r`` (rounded down or up at random), sent with the sign as ``sign(g) l + s`` in
    ``field_bits(s)``-bit fields of int64 words (8 bits for the default s = 127: the words' bytes). Decoded as
    ``r sign(g) l / s`` and summed over the ranks: unbiased. A non-finite entry makes its norm non-finite, and so
    every entry of its parameter on every rank."""

    def __init__(self, levels: int = 127, seed: int = 0):
        super().__init__(seed, "qsgd")
        self.levels, self.bits = levels, field_bits(levels)
        bits = self.bits
        self.traits = Traits(ALLGATHER, UNBIASED, Keeps.RANK, rows=None,
                             wire_bytes=lambda b, world: 4 * len(b.numels) + 8 * bitpack.packed_words(b.numel, bits))

    def encode(self, x, state, layout):
        v, lengths = work_values(x, layout)
        n, s = v.numel(), self.levels
        norms = wire_scale(segment_reduce(v * v, lengths, "sum").sqrt_())
        # a zero parameter (0 / 0) scales by 0 instead: level 0; so does a non-finite norm (its decode is NaN)
        factors = torch.where(norms > 0, s / norms, 0.0).to(v.dtype)
        signed = stochastic_round(v * expand(factors, lengths, n), self.stream.next(v.device))
        fields = signed.clamp_(-s, s).nan_to_num_().add_(s)  # l + s in [0, 2s]
        return Payload([norms, pack_fields(fields, self.bits)], (lengths, x.dtype, n)), state

    def decode(self, received, ctx):
        norms, words = received  # (ranks, parameters) fp32, (ranks, words) int64
        lengths, dtype, n = ctx
        units = norms.to(work_dtype(dtype)) / self.levels
        return scaled_sum(unpack_rows(words, n, self.bits), self.levels, units, lengths, dtype)
