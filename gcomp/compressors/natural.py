"""``natural``: each entry rounded at random to a neighbouring power of two (Horváth et al. 2019, natural
compression), sent as its sign and its 8-bit fp32 exponent."""
from __future__ import annotations

from typing import Annotated

import torch

from gcomp.collectives import AllgatherCommunicator, bitpack
from gcomp.compressors import natural_device
from gcomp.compressors.bernoulli import sparse_nonzero
from gcomp.compressors.quantise import (RankGenerator, RankwiseCtx, RankwiseDecoder, Scratch, SeededState,
                                        rank_and_world, work_dtype)
from gcomp.core import ALLGATHER, Payload
from gcomp.kernels import on_device
from gcomp.memory import NoMemory
from gcomp.method import Method
from gcomp.params import Range
from gcomp.registry import register

_MANTISSA_BITS = 23



class NaturalCompressor(SeededState, RankwiseDecoder):
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

    On a CPU the carry takes one random byte per entry, refined by a 15-bit draw only where the mantissa's top
    byte ties (``round_exponents``; the same probability, exactly). The decode builds each value's top 16 bits
    (a bfloat16, widened exactly) and writes the few NaN codes where they are. On the device path
    (``gcomp.kernels.on_device``) the rounding takes one 23-bit draw per entry and the decode two gathers per rank,
    a fixed number of whole-bucket operations (``natural_device``).

    Memory: per bucket layout, one draws buffer of the bucket's fp32 size (also the decode's work space), one
    of half that (int16), a byte per entry for the signs (also the random bytes) and for the NaN flags, and for
    16-bit and fp64 buckets the fp32 entries (a second fp32 one in a multi-rank decode); nothing of the
    bucket's size is allocated per step but the exponents and ``decompress``'s result.
    """

    collective = ALLGATHER

    def __init__(self, seed: int = 0):
        self.random = RankGenerator(seed, "natural")
        self.scratch = Scratch()

    def bind(self, model, group, stats) -> None:
        self.random.bind(rank_and_world(group)[0])

    def buffers(self, key: str, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The draws buffer (int32 entries, also the decode's work space: two int16 planes) and the signs (a
        byte per entry, zero-padded to whole 64-bit words)."""
        padded = bitpack.packed_words(n, 1) * 64
        words = self.scratch.get(key, "draws", -(-padded // 2), torch.int64, device)
        return words.view(torch.int32), self.scratch.get(key, "signs", padded, torch.uint8, device)

    def round_exponents(self, bits: torch.Tensor, key: str, generator: torch.Generator) -> torch.Tensor:
        """The biased exponent of each entry (fp32 ``bits``) rounded up with probability ``m / 2^23`` (``m``
        its mantissa), as uint8 (a NaN's: anything). On a CPU from one random byte per entry: with ``t`` the
        mantissa's top 8 bits, ``l`` its low 15 and ``w`` a random byte, ``e:t + w`` (16-bit) carries into
        the exponent when ``t + w >= 256`` (probability ``t / 256``); where ``t + w = 255`` (1 in 256) a
        15-bit draw ``v`` decides, carrying when ``l + v >= 2^15``: in all ``P(up) = m / 2^23`` exactly."""
        n, device = bits.numel(), bits.device
        draws, signs = self.buffers(key, n, device)
        exponent = torch.empty(n, dtype=torch.uint8, device=device)
        if device.type != "cpu" or on_device(bits):  # one 23-bit draw per entry, added as a carry: no host read
            return natural_device.round_up(bits, draws, exponent, generator)
        random = signs.view(torch.int64)  # free until the signs are written: a byte per entry
        random.random_(-2**63, None, generator=generator)  # every bit uniform
        top = torch.bitwise_right_shift(bits, _MANTISSA_BITS - 8, out=draws[:n])  # e:t in the low 16 bits
        plane = self.scratch.get(key, "plane", n, torch.int16, device).copy_(top)  # truncated: e:t
        plane.add_(draws.view(torch.int16)[:n].copy_(signs[:n]))  # e:t + w (draws is free): carries into e
        torch.eq(exponent.copy_(plane), 255, out=signs[:n].view(torch.bool))  # t + w = 255: undecided
        undecided = sparse_nonzero(signs[:n])
        exponent.copy_(plane.bitwise_right_shift_(8))  # e + carry (mod 256: only inf and NaN have e = 255)
        if undecided.numel():
            low = torch.index_select(bits, 0, undecided).bitwise_and_((1 << (_MANTISSA_BITS - 8)) - 1)
            low.add_(torch.randint(0, 1 << (_MANTISSA_BITS - 8), low.shape, generator=generator,
                                   dtype=torch.int32, device=device))
            exponent.index_add_(0, undecided, low.bitwise_right_shift_(_MANTISSA_BITS - 8).to(torch.uint8))
        return exponent

    def compress(self, tensor, bucket):
        flat = tensor.reshape(-1)
        n = flat.numel()
        values = flat if flat.dtype == torch.float32 else \
            self.scratch.get(bucket.key, "values", n, torch.float32, flat.device).copy_(flat)
        bits = values.view(torch.int32)
        exponent = self.round_exponents(bits, bucket.key, self.random(bits.device))
        _, signs = self.buffers(bucket.key, n, bits.device)
        signs[n:].zero_()  # the padding of the last word
        torch.lt(values, 0, out=signs[:n].view(torch.bool))  # -0 and NaN: not negative
        torch.minimum(signs[:n], exponent, out=signs[:n])  # a value rounded to 0 is sent as +0
        nan = torch.ne(values, values, out=self.scratch.get(bucket.key, "nan", n, torch.bool, bits.device))
        signs[:n].bitwise_or_(nan.view(torch.uint8))
        exponent.bitwise_and_(nan.view(torch.uint8).sub_(1))  # 0 where NaN (1 - 1), else & 255 (0 - 1)
        packed = bitpack.pack_flags_(signs) if bitpack.little_endian() else bitpack.pack(signs, 1)
        return Payload([exponent, packed], RankwiseCtx(n, tensor.dtype, (), bucket.key, tensor))

    def decode(self, gathered, ctx: RankwiseCtx, out: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of the decoded powers of two written into ``out``, rank by rank: the top 16 bits
        of each fp32 value, ``(exponent << 7) | (sign << 15)``, built as int16 in the draws buffer and widened
        as bfloat16 (exact); the NaN code (sign 1, exponent 0: the bits of -0) is then written where it is."""
        exponents, signs = gathered  # (world, n) uint8, (world, words) int64
        n, work, world = ctx.n, work_dtype(ctx.dtype), exponents.shape[0]
        draws, _ = self.buffers(ctx.key, n, exponents.device)
        planes = draws.view(torch.int16)
        high, shifted = planes[:n], planes[n:2 * n]
        total = out if out.dtype == work else self.scratch.get(ctx.key, "sum", n, work, out.device)
        nan = self.scratch.get(ctx.key, "nan", n, torch.bool, out.device)
        if on_device(exponents):
            rows = self.scratch.get(ctx.key, "rows", signs.shape[1] * 8, torch.int32, out.device)
            space = self.scratch.get(ctx.key, "rank", n, work, out.device)
            natural_device.decode(exponents, signs, n, total, space, draws, rows)
            return out if total is out else out.copy_(total)
        table = self._sign_table(exponents.device)
        for rank in range(world):  # a loop over ranks, not entries
            if bitpack.little_endian():
                bitpack.unpack_table(signs[rank], n, table, out=high)  # sign << 15
            else:
                high.copy_(bitpack.unpack(signs[rank], n, 1, dtype=torch.int16)).bitwise_left_shift_(15)
            high.bitwise_or_(shifted.copy_(exponents[rank]).bitwise_left_shift_(7))
            torch.eq(high, -2**15, out=nan)  # the NaN code
            target = total if rank == 0 else self.scratch.get(ctx.key, "rank", n, work, out.device)
            target.copy_(high.view(torch.bfloat16))
            # few NaN codes (the usual case) are written where they are; many, or on a GPU, by a masked fill
            where = sparse_nonzero(nan, most=n // 256) if target.device.type == "cpu" else None
            if where is None:
                target.masked_fill_(nan, torch.nan)
            elif where.numel():
                target.index_fill_(0, where, torch.nan)
            if rank:
                total.add_(target)
        return out if total is out else out.copy_(total)

    def _sign_table(self, device) -> torch.Tensor:
        zero = torch.zeros((), dtype=torch.int16, device=device)
        return bitpack.bit_table(zero, torch.full((), -2**15, dtype=torch.int16, device=device))


@register("natural", paper="Horváth, Ho, Horváth, Sahu, Canini, Richtárik 2019 (natural compression)")
def natural(seed: Annotated[int, Range(0, None), "seed of the draws (each rank draws its own stream from it)"] = 0
            ) -> Method:
    """Natural compression: entries rounded at random to a power of two (unbiased), 9 bits each, all-gather."""
    return Method(NaturalCompressor(seed), NoMemory(), AllgatherCommunicator())
