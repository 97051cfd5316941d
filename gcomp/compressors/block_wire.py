"""The byte layout of ``gcomp.compressors.block_formats``'s element codes: FP6 codes packed 4 to 3 bytes, FP4 codes
2 to a byte, and the decode's tables of pairs (one index gives two fp32 entries, read as one int64)."""
from __future__ import annotations

import torch

from gcomp.compressors import minifloat
from gcomp.compressors.minifloat import Minifloat


def check_length(n: int, block: int, name: str) -> None:
    if not isinstance(n, int) or n < 0 or n % block:
        raise ValueError(f"{name} takes a multiple of its block of {block} entries, not {n!r}")


def pack(codes: torch.Tensor, bits: int, out: torch.Tensor) -> torch.Tensor:
    """``codes`` (uint8, each below ``2^bits``; a multiple of 4 of them, contiguous) packed into ``out`` (uint8,
    ``len * bits / 8`` bytes): 6-bit codes as ``c0 | c1 << 6 | c2 << 12 | c3 << 18`` in 3 little-endian bytes,
    4-bit ones as ``c0 | c1 << 4``. Each group is read as one little-endian integer (int16 for a pair, int32 for
    four) and its fields are moved by whole-tensor shifts."""
    if bits == 4:
        pairs = codes.view(torch.int16)  # c0 | c1 << 8
        return out.copy_(pairs.bitwise_or(pairs.bitwise_right_shift(4)))  # the low byte: c0 | c1 << 4
    if bits != 6:
        raise ValueError(f"only 4- and 6-bit codes are packed, not {bits}")
    word = codes.view(torch.int32)  # c0 | c1 << 8 | c2 << 16 | c3 << 24
    packed = word.bitwise_and(0x3F)
    for k, mask in ((1, 0xFC0), (2, 0x3F000), (3, 0xFC0000)):
        packed.bitwise_or_(word.bitwise_right_shift(2 * k).bitwise_and_(mask))
    out.view(-1, 3).copy_(packed.view(torch.uint8).view(-1, 4)[:, :3])
    return out


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The ``n`` codes ``pack`` put in ``packed`` (uint8)."""
    if bits == 8:
        return packed[:n].clone()
    if bits == 4:
        out = torch.empty(n, dtype=torch.uint8, device=packed.device).view(-1, 2)
        torch.bitwise_and(packed, 15, out=out[:, 0])
        torch.bitwise_right_shift(packed, 4, out=out[:, 1])
        return out.view(-1)
    b, out = packed.view(-1, 3), torch.empty(n, dtype=torch.uint8, device=packed.device).view(-1, 4)
    torch.bitwise_and(b[:, 0], 63, out=out[:, 0])
    out[:, 1] = (b[:, 0] >> 6) | ((b[:, 1] & 15) << 2)
    out[:, 2] = (b[:, 1] >> 4) | ((b[:, 2] & 3) << 4)
    torch.bitwise_right_shift(b[:, 2], 2, out=out[:, 3])
    return out.view(-1)


_PAIRS: dict[tuple[str, str], torch.Tensor] = {}


def pair_table(fmt: Minifloat, device: torch.device | str) -> torch.Tensor:
    """Two entries' values per index, as int64 (the two fp32 side by side): the index is a packed FP4 byte
    (``c0 | c1 << 4``), 12 bits of packed FP6 (``c0 | c1 << 6``) or two FP8 codes (``c0 | c1 << 8``)."""
    key = (fmt.name, str(torch.device(device)))
    found = _PAIRS.get(key)
    if found is None:
        values = minifloat.table(fmt, "cpu")
        index = torch.arange(1 << (2 * fmt.bits))
        mask = (1 << fmt.bits) - 1
        pairs = torch.stack([values[index & mask], values[index >> fmt.bits]], 1).contiguous()
        found = _PAIRS[key] = pairs.view(torch.int64).view(-1).to(device)
    return found


def pair_index(packed: torch.Tensor, bits: int, out: torch.Tensor) -> torch.Tensor:
    """The indices into ``pair_table`` of the packed codes ``packed`` (uint8), written into ``out`` (int32, one per
    two codes). Packed FP6 is read a group at a time as ``b0 | b1 << 8 | b2 << 16``: its two 12-bit halves."""
    if bits == 4:
        return out.copy_(packed)
    if bits == 8:
        return out.copy_(packed.view(torch.int16)).bitwise_and_(0xFFFF)
    pairs = out.view(-1, 2)
    word = torch.empty(pairs.shape[0], dtype=torch.int32, device=out.device)
    word.view(torch.uint8).view(-1, 4)[:, 3] = 0
    word.view(torch.uint8).view(-1, 4)[:, :3] = packed.view(-1, 3)
    torch.bitwise_and(word, 0xFFF, out=pairs[:, 0])
    torch.bitwise_right_shift(word, 12, out=pairs[:, 1])
    return out
