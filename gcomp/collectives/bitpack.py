"""Bit packing into int64 words: k-bit codes for all-gather, and integer lanes that survive a SUM all-reduce.

A value in ``[0, 2**bits)`` goes into a ``bits``-wide field; ``64 // bits`` fields share one int64 word (field j of
word w holds entry ``w * (64 // bits) + j``). Summing packed words over N ranks sums every field at once, and no
carry crosses into the next field as long as each field's sum stays below ``2**bits``; ``lane_bits(N, max_value)``
picks that width. gloo and NCCL both sum int64, and a SUM that runs into the sign bit wraps modulo 2**64, which
leaves every field intact: the top field may use the sign bit.

Each call is a fixed handful of bucket-wide operations whatever the size and width: the fields of every word are
placed by one broadcast shift of an ``(words, fields)`` grid and summed (their bits are disjoint: the sum is their
OR), or cut out of it by one shift and one mask. One-bit fields have two more: ``pack_flags_`` packs 8 flags per
int64 multiply, and ``unpack_table`` decodes each byte of the words straight into 8 values of a lookup table (a
scale and its negative, say) by one gather.
"""
from __future__ import annotations

import sys

import torch

WORD_BITS = 64
# Times 8 flags (one byte each, 0 or 1, in one int64), this puts flag j at bit 56 + j and nothing else in the
# top byte: flag j meets the constant's byte 7 - j, which holds 2**(7 - j) (the sum of the two byte positions is
# 7, so the bit lands at 8 * 7 + j). Lower products never reach bit 56; higher ones wrap past bit 63.
_GATHER_FLAGS = 0x0102040810204080
_LITTLE = sys.byteorder == "little"  # bytes of a word in field order: the byte-wise paths below rely on it


def little_endian() -> bool:
    """Whether the byte-wise paths (``pack_flags_``, ``unpack_table``) see a word's bytes in field order."""
    return _LITTLE


def lane_bits(world_size: int, max_value: int = 2) -> int:
    """The narrowest field holding the sum over ``world_size`` ranks of values in ``[0, max_value]``.

    For ternary codes stored as t + 1 (``max_value=2``) that is ceil(log2(2N + 1)): 2 bits for one rank,
    4 for four, 12 for 1024.
    """
    if world_size < 1 or max_value < 1:
        raise ValueError(f"world_size and max_value must be at least 1; got {world_size}, {max_value}")
    bits = (world_size * max_value).bit_length()
    if bits > WORD_BITS - 1:
        raise ValueError(f"a sum of {world_size} values up to {max_value} needs {bits} bits, more than a lane holds")
    return bits


def fields_per_word(bits: int) -> int:
    if not 1 <= bits <= WORD_BITS - 1:
        raise ValueError(f"bits must be in [1, {WORD_BITS - 1}]; got {bits}")
    return WORD_BITS // bits


def packed_words(n: int, bits: int) -> int:
    """How many int64 words ``n`` fields of ``bits`` bits take."""
    per_word = fields_per_word(bits)
    return -(-n // per_word)


def pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """The flat integer ``values`` in ``[0, 2**bits)`` as int64 words. Entries outside that range corrupt their
    neighbours: callers guarantee it."""
    per_word = fields_per_word(bits)
    n = values.numel()
    words = -(-n // per_word)
    grid = torch.zeros(words * per_word, dtype=torch.int64, device=values.device)
    grid[:n].copy_(values.reshape(-1))
    shifts = torch.arange(0, per_word * bits, bits, dtype=torch.int64, device=values.device)
    return grid.view(words, per_word).bitwise_left_shift_(shifts).sum(1)


def unpack(words: torch.Tensor, n: int, bits: int, dtype: torch.dtype = torch.int64,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """The first ``n`` fields of the flat int64 ``words`` (their values, or their sums over ranks after an
    all-reduce), as ``dtype``, written into ``out[:n]`` if given."""
    per_word = fields_per_word(bits)
    if words.numel() * per_word < n:
        raise ValueError(f"{words.numel()} words of {per_word} fields cannot hold {n} fields")
    shifts = torch.arange(0, per_word * bits, bits, dtype=torch.int64, device=words.device)
    # an arithmetic shift of a negative word fills with ones: the mask removes them
    fields = words.reshape(-1, 1).bitwise_right_shift(shifts).bitwise_and_((1 << bits) - 1).view(-1)[:n]
    if out is None:
        return fields.to(dtype)
    return out[:n].copy_(fields)


def pack_flags_(flags: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``pack(flags, 1)`` of a flat bool or uint8 tensor of 0s and 1s, into ``out`` (``packed_words(n, 1)`` int64
    words) if given: one multiply and one shift per 8 flags. ``flags`` is overwritten (it is scratch)."""
    n = flags.numel()
    if not _LITTLE:
        packed = pack(flags, 1)
        return packed if out is None else out.copy_(packed)
    if out is None:
        out = torch.empty(packed_words(n, 1), dtype=torch.int64, device=flags.device)
    dst = out.view(torch.uint8)
    whole = n // 8
    if whole:
        lanes = flags[:whole * 8].view(torch.uint8).view(torch.int64)
        dst[:whole].copy_(lanes.mul_(_GATHER_FLAGS).bitwise_right_shift_(56))  # the top byte, cut to uint8
    if n > whole * 8:
        tail = flags[whole * 8:].to(torch.int64)
        dst[whole] = tail.bitwise_left_shift_(torch.arange(tail.numel(), device=tail.device)).sum()
        whole += 1
    dst[whole:].zero_()  # the padding bits of the last word
    return out


def bit_table(zero: torch.Tensor, one: torch.Tensor) -> torch.Tensor:
    """The lookup table of ``unpack_table``: ``(..., 256, 8)`` with entry ``[..., v, j]`` equal to ``one`` where bit
    j of the byte v is set and ``zero`` where not. ``zero`` and ``one`` are tensors of shape ``(..., 1, 1)`` or
    ``(..., 1, 8)`` (a value per bit position), or 0-d; the table takes their dtype."""
    pattern = (torch.arange(256, device=one.device)[:, None]
               .bitwise_right_shift(torch.arange(8, device=one.device)).bitwise_and_(1).bool())
    return torch.where(pattern, one, zero)


def word_bytes(words: torch.Tensor, count: int) -> torch.Tensor:
    """The first ``count`` bytes of the flat int64 ``words`` in field order (bits 8b to 8b + 7 in byte b), uint8."""
    if _LITTLE:
        return words.contiguous().view(torch.uint8)[:count]
    return unpack(words, count, 8, dtype=torch.uint8)


def unpack_table(words: torch.Tensor, n: int, table: torch.Tensor, out: torch.Tensor | None = None,
                 base: torch.Tensor | None = None) -> torch.Tensor:
    """The ``n`` one-bit fields of the flat int64 ``words`` decoded through ``table`` (``(rows, 8)``, as ``bit_table``
    builds): entry i is ``table[byte, i % 8]`` for the byte holding bit i, plus ``base[i // 8]`` where ``base``
    (int32, one per byte) picks one of several stacked 256-row tables. Written into ``out`` if given."""
    if words.numel() * WORD_BITS < n:
        raise ValueError(f"{words.numel()} words of {WORD_BITS} fields cannot hold {n} fields")
    index = word_bytes(words, -(-n // 8)).to(torch.int32)
    if base is not None:
        index = index.add_(base[:index.numel()])
    decoded = torch.index_select(table, 0, index).view(-1)[:n]
    return decoded if out is None else out[:n].copy_(decoded)
