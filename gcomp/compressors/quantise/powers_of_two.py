"""Natural compression's codec: each entry rounded at random to a neighbouring power of two, sent as its sign and
its 8-bit fp32 exponent."""
from __future__ import annotations

import torch

from gcomp.collectives import bitpack
from gcomp.compressors.quantise.rounding import StochasticCompressor, unpack_rows, work_dtype
from gcomp.core import ALLGATHER, UNBIASED, Keeps, Payload, Traits

MANTISSA_BITS = 23
NAN_CODE = -2**31  # sign 1, exponent 0: the bits of -0, which no value is sent as


class NaturalCompressor(StochasticCompressor):
    """Natural compression by all-gather: 9 bits per entry in two planes, the biased fp32 exponent of the rounded
    value (a byte per entry) and the signs (1-bit fields of int64 words).

    An entry ``2^e (1 + m / 2^23)`` (fp32 exponent ``e``, mantissa ``m``) becomes ``2^e`` or ``2^(e+1)``, up with
    probability ``m / 2^23``: a draw ``u`` uniform on [0, 2^23) added to the entry's bits carries into the exponent
    exactly when ``u >= 2^23 - m``, exactly unbiased. Subnormals round to 0 or the smallest normal by the same rule.
    Codes: exponent 0 with sign 0 is zero, exponent 255 infinity (also the rare round-up past the largest float),
    exponent 0 with sign 1 NaN (-0 is sent as +0). 16-bit buckets widen to fp32 exactly; fp64 buckets are first
    rounded to fp32 (to nearest). The decoded powers of two sum over the ranks in fp32 (fp64 for fp64 buckets)."""

    def __init__(self, seed: int = 0):
        super().__init__(seed, "natural")
        self.traits = Traits(ALLGATHER, UNBIASED, Keeps.RANK, rows=None,
                             wire_bytes=lambda bucket, world: bucket.numel + 8 * bitpack.packed_words(bucket.numel, 1))

    def encode(self, x, state, layout):
        values = x.reshape(-1).to(torch.float32)
        bits = values.view(torch.int32)
        draws = torch.randint(0, 1 << MANTISSA_BITS, bits.shape, generator=self.stream.next(bits.device),
                              dtype=torch.int32, device=bits.device)
        exponent = draws.add_(bits).bitwise_right_shift_(MANTISSA_BITS).to(torch.uint8)  # e + carry, mod 256
        nan = values.isnan()
        signs = (values < 0) & (exponent > 0) | nan  # a value rounded to 0 is sent as +0
        return Payload([exponent.masked_fill_(nan, 0), bitpack.pack_flags_(signs)], x.dtype), state

    def decode(self, received, ctx):
        exponents, signs = received  # (ranks, n) uint8, (ranks, words) int64
        high = unpack_rows(signs, exponents.shape[1], 1).to(torch.int32).mul_(NAN_CODE)  # the sign bit
        code = high.bitwise_or_(exponents.to(torch.int32).bitwise_left_shift_(MANTISSA_BITS))  # the fp32 bits
        values = code.view(torch.float32).to(work_dtype(ctx)).masked_fill_(code == NAN_CODE, torch.nan)
        return values.sum(0).to(ctx)
