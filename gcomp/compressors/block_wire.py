"""The byte layout of ``gcomp.compressors.block_formats``'s element codes, and the decode's tables of pairs (one
index gives two fp32 entries, read as one int64).

- 8-bit codes: a byte each.
- FP4: 2 codes to a byte, the first in the low nibble (``c0 | c1 << 4``).
- FP6, in two planes over the ``n`` entries: first ``n / 2`` bytes of low nibbles (``lo(c0) | lo(c1) << 4``, as
  FP4), then ``n / 4`` bytes of the top 2 bits (``hi(c0) | hi(c1) << 2 | hi(c2) << 4 | hi(c3) << 6``), where
  ``c = lo | hi << 4``. Both planes are written and read as whole words (int16, int32): no strided bytes.
"""
from __future__ import annotations

import torch

from gcomp.compressors import minifloat
from gcomp.compressors.minifloat import Minifloat


def check_length(n: int, block: int, name: str) -> None:
    if not isinstance(n, int) or n < 0 or n % block:
        raise ValueError(f"{name} takes a multiple of its block of {block} entries, not {n!r}")


def _planes(packed: torch.Tensor, bits: int, n: int, start: int, stop: int):
    """The bytes of entries ``[start, stop)`` (multiples of 4) in the wire tensor ``packed`` of ``n`` entries."""
    if bits == 8:
        return packed[start:stop], None
    low = packed[start // 2:stop // 2]
    return low, (packed[n // 2 + start // 4:n // 2 + stop // 4] if bits == 6 else None)


def _nibbles(codes: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``c0 & 15 | (c1 & 15) << 4`` of each pair of the uint8 ``codes``, into ``out`` (uint8)."""
    pairs = codes.view(torch.int16).bitwise_and(0x0F0F)  # lo(c0) | lo(c1) << 8
    return out.copy_(pairs.bitwise_or_(pairs.bitwise_right_shift(4)))  # the low byte


def pack(codes: torch.Tensor, bits: int, packed: torch.Tensor, n: int, start: int = 0) -> torch.Tensor:
    """The uint8 ``codes`` of entries ``[start, start + len)`` (each below ``2^bits``, a multiple of 4 of them)
    written into ``packed``, the uint8 wire tensor of ``n`` entries, in the layout above."""
    if bits not in (4, 6):
        raise ValueError(f"only 4- and 6-bit codes are packed, not {bits}")
    low, high = _planes(packed, bits, n, start, start + codes.numel())
    _nibbles(codes, low)
    if bits == 6:
        words = codes.view(torch.int32).bitwise_right_shift(4).bitwise_and_(0x03030303)  # hi(c_k) at bit 8k
        words.bitwise_or_(words.bitwise_right_shift(6))  # hi(c1) at bit 2, hi(c3) at 18
        high.copy_(words.bitwise_or_(words.bitwise_right_shift(12)))  # the low byte: all four
    return packed


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The ``n`` codes ``pack`` put in ``packed`` (uint8), one per byte."""
    if bits == 8:
        return packed[:n].clone()
    low, high = _planes(packed, bits, n, 0, n)
    out = torch.empty(n, dtype=torch.uint8, device=packed.device).view(-1, 2)
    torch.bitwise_and(low, 15, out=out[:, 0])
    torch.bitwise_right_shift(low, 4, out=out[:, 1])
    if bits == 6:
        tops = out.view(-1, 4)
        for k in range(4):
            tops[:, k].bitwise_or_(high.bitwise_right_shift(2 * k).bitwise_and_(3).bitwise_left_shift_(4))
    return out.view(-1)


_PAIRS: dict[tuple[str, str], torch.Tensor] = {}


def pair_table(fmt: Minifloat, device: torch.device | str) -> torch.Tensor:
    """Two entries' values per index, as int64 (the two fp32 side by side): the index is two FP8 codes
    (``c0 | c1 << 8``), a packed FP4 byte (``c0 | c1 << 4``), or for FP6 a byte of low nibbles and the two codes'
    top bits above it (``lo(c0) | lo(c1) << 4 | hi(c0) << 8 | hi(c1) << 10``)."""
    key = (fmt.name, str(torch.device(device)))
    found = _PAIRS.get(key)
    if found is None:
        values = minifloat.table(fmt, "cpu")
        index = torch.arange(1 << (2 * fmt.bits))
        if fmt.bits == 6:
            first = (index & 15) | ((index >> 8) & 3) << 4
            second = ((index >> 4) & 15) | ((index >> 10) & 3) << 4
        else:
            first, second = index & ((1 << fmt.bits) - 1), index >> fmt.bits
        pairs = torch.stack([values[first], values[second]], 1).contiguous()
        found = _PAIRS[key] = pairs.view(torch.int64).view(-1).to(device)
    return found


def pair_index(packed: torch.Tensor, bits: int, n: int, start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
    """The indices into ``pair_table`` of entries ``[start, stop)`` of the wire tensor ``packed`` (``n`` entries),
    written into ``out`` (int32, one per two entries)."""
    low, high = _planes(packed, bits, n, start, stop)
    if bits == 8:
        return out.copy_(low.view(torch.uint16))  # unsigned: no sign to mask off
    out.copy_(low)
    if bits == 6:  # each byte of tops holds two pairs' 4 bits: spread them to one per pair, then above the nibbles
        spread = high.to(torch.int16)
        spread.bitwise_or_(spread.bitwise_left_shift(4)).bitwise_and_(0x0F0F)
        out.add_(spread.view(torch.uint8).to(torch.int32).bitwise_left_shift_(8))
    return out
