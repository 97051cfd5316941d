"""``natural``: each entry rounded at random to a neighbouring power of two (Horváth et al. 2019, natural
compression), sent as its sign and its 8-bit fp32 exponent."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import torch

from gcomp.collectives import AllgatherCommunicator, bitpack
from gcomp.compressors.quantise import RankGenerator, SeededState, rank_and_world, work_dtype
from gcomp.core import ALLGATHER, Compressor, Method, Payload
from gcomp.memory import NoMemory
from gcomp.params import Range
from gcomp.registry import register

_MANTISSA_BITS = 23
_MANTISSA = (1 << _MANTISSA_BITS) - 1


@dataclass
class _Ctx:
    n: int
    dtype: torch.dtype


class NaturalCompressor(SeededState, Compressor):
    """Natural compression by all-gather: 9 bits per entry in two byte-aligned planes, the biased fp32
    exponent of the rounded value (one uint8 per entry) and the signs (1-bit fields, ``bitpack``).

    An entry ``2^e (1 + m / 2^23)`` (fp32 exponent ``e``, mantissa ``m``) becomes ``2^e`` or ``2^(e+1)``, up
    with probability ``m / 2^23``, drawn as an integer comparison: exactly unbiased. Subnormals round to 0 or
    the smallest normal by the same rule, also unbiased. Codes: exponent 0 with sign 0 is zero, exponent
    255 is infinity (also the rare round-up past the largest float), and exponent 0 with sign 1, which no
    value uses (-0 is sent as +0), carries NaN. 16-bit buckets widen to fp32 exactly; fp64 buckets are first
    rounded to fp32 (to nearest). The decoded powers of two sum in fp32 (fp64 for fp64 buckets).
    """

    collective = ALLGATHER

    def __init__(self, seed: int = 0):
        self.random = RankGenerator(seed, "natural")

    def bind(self, model, group, stats) -> None:
        self.random.bind(rank_and_world(group)[0])

    def compress(self, tensor, bucket):
        bits = tensor.to(torch.float32).reshape(-1).view(torch.int32)
        n = bits.numel()
        exponent = bits.bitwise_right_shift(_MANTISSA_BITS).bitwise_and_(0xFF)
        draws = torch.randint(0, 1 << _MANTISSA_BITS, (n,), generator=self.random(bits.device),
                              dtype=torch.int32, device=bits.device)
        nan = (exponent == 0xFF) & (bits.bitwise_and(_MANTISSA) != 0)
        exponent += draws < bits.bitwise_and(_MANTISSA)  # infinity (mantissa 0) never rounds up
        exponent.masked_fill_(nan, 0)
        negative = ((bits < 0) & (exponent > 0)) | nan
        payload = [exponent.to(torch.uint8), bitpack.pack(negative.to(torch.uint8), 1)]
        return Payload(payload, _Ctx(n, tensor.dtype))

    def decompress(self, tensors, ctx: _Ctx):
        return self.aggregate([t.unsqueeze(0) for t in tensors], ctx)

    def aggregate(self, gathered, ctx: _Ctx):
        exponents, signs = gathered  # (world, n) uint8, (world, words) int64
        world = exponents.shape[0]
        exponent = exponents.to(torch.int32)
        sign = bitpack.unpack(signs.reshape(-1), signs.numel() * 64, 1, dtype=torch.int32).view(world, -1)
        sign = sign[:, :ctx.n]
        values = sign.bitwise_left_shift(31).bitwise_or_(exponent.bitwise_left_shift(_MANTISSA_BITS))
        values = values.view(torch.float32).masked_fill_((exponent == 0) & (sign != 0), torch.nan)
        return values.sum(0, dtype=work_dtype(ctx.dtype)).to(ctx.dtype)



@register("natural", paper="Horváth, Ho, Horváth, Sahu, Canini, Richtárik 2019 (natural compression)")
def natural(seed: Annotated[int, Range(0, None), "seed of the draws (each rank draws its own stream from it)"] = 0
            ) -> Method:
    """Natural compression: entries rounded at random to a power of two (unbiased), 9 bits each, all-gather."""
    return Method(NaturalCompressor(seed), NoMemory(), AllgatherCommunicator())
