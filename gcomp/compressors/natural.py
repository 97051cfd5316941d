"""``natural``: each entry rounded at random to a neighbouring power of two (Horváth et al. 2019, natural
compression), sent as its sign and its 8-bit fp32 exponent."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import torch

from gcomp.collectives import AllgatherCommunicator, bitpack
from gcomp.compressors.quantise import RankGenerator, Scratch, SeededState, rank_and_world, work_dtype
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
    key: str  # the bucket layout: its scratch buffers
    tensor: torch.Tensor  # what was compressed: ``aggregate`` (the hook's decode) writes the result into it


class NaturalCompressor(SeededState, Compressor):
    """Natural compression by all-gather: 9 bits per entry in two byte-aligned planes, the biased fp32
    exponent of the rounded value (one uint8 per entry) and the signs (1-bit fields, ``bitpack``).

    An entry ``2^e (1 + m / 2^23)`` (fp32 exponent ``e``, mantissa ``m``) becomes ``2^e`` or ``2^(e+1)``, up
    with probability ``m / 2^23``, drawn as an integer carry: a draw ``u`` uniform on [0, 2^23) added to the
    entry's bits carries into the exponent exactly when ``u >= 2^23 - m``: exactly unbiased. Subnormals round
    to 0 or the smallest normal by the same rule, also unbiased. Codes: exponent 0 with sign 0 is zero,
    exponent 255 is infinity (also the rare round-up past the largest float), and exponent 0 with sign 1,
    which no value uses (-0 is sent as +0), carries NaN. 16-bit buckets widen to fp32 exactly; fp64 buckets
    are first rounded to fp32 (to nearest). The decoded powers of two sum in fp32 (fp64 for fp64 buckets).
    ``aggregate`` writes that sum into the tensor that was compressed (the hook's bucket, as an all-reduce
    would) and returns it; ``decompress`` returns a new tensor.

    Memory: per bucket layout, one draws buffer of the bucket's fp32 size (also the decode's work space) and a
    byte per entry for the signs, and for 16-bit and fp64 buckets the fp32 entries; nothing of the bucket's
    size is allocated per step but ``decompress``'s result.
    """

    collective = ALLGATHER

    def __init__(self, seed: int = 0):
        self.random = RankGenerator(seed, "natural")
        self.scratch = Scratch()

    def bind(self, model, group, stats) -> None:
        self.random.bind(rank_and_world(group)[0])

    def buffers(self, key: str, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The draws buffer (int32 entries, also the decode's work space) and the signs (a byte per entry,
        zero-padded to whole 64-bit words)."""
        padded = bitpack.packed_words(n, 1) * 64
        words = self.scratch.get(key, "draws", -(-padded // 2), torch.int64, device)
        return words.view(torch.int32), self.scratch.get(key, "signs", padded, torch.uint8, device)

    def compress(self, tensor, bucket):
        flat = tensor.reshape(-1)
        n = flat.numel()
        values = flat if flat.dtype == torch.float32 else \
            self.scratch.get(bucket.key, "values", n, torch.float32, flat.device).copy_(flat)
        bits = values.view(torch.int32)
        draws, signs = self.buffers(bucket.key, n, bits.device)
        draws.view(torch.int64).random_(-2**63, None, generator=self.random(bits.device))  # every bit uniform
        carry = draws[:n].bitwise_and_(_MANTISSA).add_(bits)  # u + bits: the exponent gains the carry
        # bits 23..30 of the sum: the rounded exponent (of a NaN: anything, overwritten below)
        exponent = torch.empty(n, dtype=torch.uint8, device=bits.device).copy_(carry.bitwise_right_shift_(23))
        signs[n:].zero_()  # the padding of the last word
        torch.lt(values, 0, out=signs[:n].view(torch.bool))  # -0 and NaN: not negative
        torch.minimum(signs[:n], exponent, out=signs[:n])  # a value rounded to 0 is sent as +0
        nan = torch.ne(values, values, out=self.scratch.get(bucket.key, "nan", n, torch.bool, bits.device))
        signs[:n].bitwise_or_(nan.view(torch.uint8))
        exponent.bitwise_and_(nan.view(torch.uint8).sub_(1))  # 0 where NaN (1 - 1), else & 255 (0 - 1)
        return Payload([exponent, bitpack.pack(signs, 1)], _Ctx(n, tensor.dtype, bucket.key, tensor))

    def decompress(self, tensors, ctx: _Ctx):
        out = torch.empty(ctx.n, dtype=ctx.dtype, device=tensors[0].device)
        return self.decode([t.unsqueeze(0) for t in tensors], ctx, out)

    def aggregate(self, gathered, ctx: _Ctx):
        return self.decode(gathered, ctx, ctx.tensor.reshape(-1)).view_as(ctx.tensor)

    def decode(self, gathered, ctx: _Ctx, out: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of the decoded powers of two written into ``out``, rank by rank: the fp32 bits
        ``(exponent + 256 sign) << 23`` built in the draws buffer (or in ``out`` itself for one fp32 rank)."""
        exponents, signs = gathered  # (world, n) uint8, (world, words) int64
        n, work, world = ctx.n, work_dtype(ctx.dtype), exponents.shape[0]
        draws, unpacked = self.buffers(ctx.key, n, exponents.device)
        total = out if out.dtype == work else self.scratch.get(ctx.key, "sum", n, work, out.device)
        nan = self.scratch.get(ctx.key, "nan", n, torch.bool, out.device)
        for rank in range(world):  # a loop over ranks, not entries
            one = rank == 0 and total.dtype == torch.float32  # decode straight into the result
            bits = total.view(torch.int32) if one else draws[:n]
            high = draws[:n] if one else self.scratch.get(ctx.key, "high", n, torch.int32, out.device)
            sign = bitpack.unpack(signs[rank], unpacked.numel(), 1, dtype=torch.uint8, out=unpacked)[:n]
            torch.gt(sign, exponents[rank], out=nan)  # sign 1 with exponent 0: the NaN code
            # (exponent + 256 sign) << 23, in plain conversions and int32 arithmetic (mixed dtypes are slow)
            bits.copy_(exponents[rank]).add_(high.copy_(sign).bitwise_left_shift_(8)).bitwise_left_shift_(23)
            decoded = bits.view(torch.float32).masked_fill_(nan, torch.nan)
            if decoded is not total:
                total.copy_(decoded) if rank == 0 else total.add_(decoded)
        return out if total is out else out.copy_(total)


@register("natural", paper="Horváth, Ho, Horváth, Sahu, Canini, Richtárik 2019 (natural compression)")
def natural(seed: Annotated[int, Range(0, None), "seed of the draws (each rank draws its own stream from it)"] = 0
            ) -> Method:
    """Natural compression: entries rounded at random to a power of two (unbiased), 9 bits each, all-gather."""
    return Method(NaturalCompressor(seed), NoMemory(), AllgatherCommunicator())
