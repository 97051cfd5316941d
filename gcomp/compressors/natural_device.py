"""``natural``'s device path (``gcomp.kernels.on_device``): the wire of the CPU path (a biased exponent byte and a
sign bit per entry), each step a fixed number of whole-bucket operations whatever the bucket's size, and no host
read.

The rounding is the counter-based one the codec takes on an accelerator: one 23-bit draw ``u`` per entry added to
the entry's bits carries into the exponent exactly when ``u >= 2^23 - m`` (``round_up``); no byte draws refined
where they tie, so nothing is looked for in the bucket. The decode loops over ranks (the world, not the bucket):
per rank, every byte of the sign plane gives ``256 sign`` for its 8 entries in one gather, the exponents are added
to it, and one gather through a 512-entry table (``value_table``: ``sign * 256 + exponent`` to the decoded power
of two, NaN at the NaN code) gives the values, then one add sums them.
"""
from __future__ import annotations

import torch

from gcomp.collectives import bitpack_device

MANTISSA_BITS = 23
_MANTISSA = (1 << MANTISSA_BITS) - 1
_TABLES: dict[tuple[str, str, torch.dtype], torch.Tensor] = {}


def round_up(bits: torch.Tensor, draws: torch.Tensor, exponent: torch.Tensor, generator: torch.Generator
             ) -> torch.Tensor:
    """The biased exponent of each entry (``bits``: fp32 bits as int32) rounded up with probability ``m / 2^23``,
    into ``exponent`` (uint8); ``draws``: an int32 buffer of an even number of at least as many entries."""
    n = bits.numel()
    draws.view(torch.int64).random_(-2**63, None, generator=generator)  # every bit uniform
    carry = draws[:n].bitwise_and_(_MANTISSA).add_(bits)
    return exponent.copy_(carry.bitwise_right_shift_(MANTISSA_BITS))  # the low 8 bits: e + carry


def _table(kind: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    key = (kind, str(device), dtype)
    table = _TABLES.get(key)
    if table is None:
        if kind == "sign":  # (256, 8): 256 where bit j of the byte v is set
            table = torch.arange(256)[:, None].bitwise_right_shift(torch.arange(8)).bitwise_and_(1).mul_(256)
        else:  # the top 16 bits of the fp32 value, (sign << 15) | (exponent << 7), widened as bfloat16 (exact)
            codes = torch.arange(512, dtype=torch.int32)
            high = (codes.bitwise_and(255).bitwise_left_shift(7) | codes.bitwise_right_shift(8).bitwise_left_shift(15))
            table = high.to(torch.int16).view(torch.bfloat16).to(torch.float64)
            table[256] = torch.nan  # sign 1, exponent 0: the NaN code (no value is sent as -0)
        table = table.to(dtype).to(device)
        _TABLES[key] = table
    return table


def value_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``(512,)`` of ``dtype``: entry ``sign * 256 + exponent`` is the decoded value (0 for exponent 0, infinity for
    255, NaN for the NaN code), as the CPU path's decode builds it (kept per device and dtype)."""
    return _table("value", device, dtype)


def decode(exponents: torch.Tensor, signs: torch.Tensor, n: int, total: torch.Tensor, space: torch.Tensor,
           index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The sum over ranks of the decoded values written into ``total`` (flat, the work dtype). ``exponents``:
    ``(world, n)`` uint8; ``signs``: ``(world, words)`` int64; ``space``: ``n`` of the work dtype; ``index``: int32,
    ``words * 64`` entries; ``rows``: int32, ``words * 8`` entries."""
    values, sign = value_table(total.device, total.dtype), _table("sign", signs.device, torch.int32)
    for rank in range(exponents.shape[0]):  # a loop over ranks, not entries
        code = bitpack_device.table_decode(signs[rank], -(-n // 8), sign, index, rows)[:n]
        code.add_(exponents[rank])  # sign * 256 + exponent
        if rank:
            total.add_(torch.index_select(values, 0, code, out=space[:n]))
        else:
            torch.index_select(values, 0, code, out=total)
    return total
