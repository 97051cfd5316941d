"""Bit packing into int64 words: k-bit codes for all-gather, and integer lanes that survive a SUM all-reduce.

A value in ``[0, 2**bits)`` goes into a ``bits``-wide field; ``64 // bits`` fields share one int64 word.
Summing packed words over N ranks sums every field at once, and no carry crosses into the next field as
long as each field's sum stays below ``2**bits``; ``lane_bits(N, max_value)`` picks that width. gloo and
NCCL both sum int64 (gloo has no int16), and a SUM that runs into the sign bit wraps modulo 2**64, which
leaves every field intact: the top field may use the sign bit.

One-bit fields have two fast paths of their own (the same layout: entry i is bit i % 64 of word i // 64):
``pack_flags_`` packs 8 flags per int64 multiply, and ``unpack_table`` decodes each byte of the words straight
into 8 values of a lookup table (the decoded floats themselves, a scale and its negative, say).
"""
from __future__ import annotations

import sys

import torch

WORD_BITS = 64
# Fields that tile a byte (1, 2, 4, 8 bits) are packed byte by byte: uint8 passes instead of int64 ones.
# Field j of a word then sits in byte j * bits // 8, which is where the int64 layout puts it on a
# little-endian machine (every machine torch supports today); elsewhere the int64 path runs.
_BYTE_FIELDS = (1, 2, 4, 8) if sys.byteorder == "little" else ()
# Times 8 flags (one byte each, 0 or 1, in one int64), this puts flag j at bit 56 + j and nothing else in the
# top byte: flag j meets the constant's byte 7 - j, which holds 2**(7 - j) (the sum of the two byte positions is
# 7, so the bit lands at 8 * 7 + j). Lower products never reach bit 56; higher ones wrap past bit 63.
_GATHER_FLAGS = 0x0102040810204080
_CHUNK_BYTES = 1 << 16  # unpack_table converts byte indices this many at a time (a small, reused buffer)
_PATTERNS: dict[str, torch.Tensor] = {}


def little_endian() -> bool:
    """Whether ``pack_flags_`` and ``unpack_table`` lay bits out as ``pack`` does (little-endian machines)."""
    return bool(_BYTE_FIELDS)


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
    """Pack a flat integer tensor with entries in ``[0, 2**bits)`` into int64 words (field j of word w holds
    ``values[w * per_word + j]``). Entries outside that range corrupt their neighbours: callers guarantee it.
    """
    per_word = fields_per_word(bits)
    n = values.numel()
    words = -(-n // per_word)
    if bits == 1 and _BYTE_FIELDS:
        flags = torch.empty(n, dtype=torch.uint8, device=values.device)  # pack_flags_ overwrites its input
        return pack_flags_(flags.copy_(values.reshape(-1)))
    if bits in _BYTE_FIELDS:
        values = values.reshape(-1).to(torch.uint8)
    if n != words * per_word:  # pad in the narrow input dtype, never in int64
        values = torch.cat([values.reshape(-1), values.new_zeros(words * per_word - n)])
    if bits in _BYTE_FIELDS:
        columns = values.reshape(-1, 8 // bits)
        out = columns[:, 0].clone(memory_format=torch.contiguous_format)
        for j in range(1, columns.shape[1]):
            out.bitwise_or_(columns[:, j].bitwise_left_shift(j * bits))
        return out.view(torch.int64)
    columns = values.reshape(words, per_word)
    out = columns[:, 0].to(torch.int64, copy=True)  # copy: an int64 input must not be written to
    for j in range(1, per_word):  # one vectorised pass per field, at most 64
        out.bitwise_or_(columns[:, j].to(torch.int64).bitwise_left_shift(j * bits))
    return out


def unpack(words: torch.Tensor, n: int, bits: int, dtype: torch.dtype = torch.int64,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """The ``n`` fields packed in ``words`` (each field's value, or its sum over ranks after an all-reduce).

    ``out``, if given, is a flat buffer of at least ``words.numel() * (64 // bits)`` entries (any dtype that
    holds the field values) that receives every field; the first ``n`` are returned.
    """
    per_word = fields_per_word(bits)
    if words.numel() * per_word < n:
        raise ValueError(f"{words.numel()} words of {per_word} fields cannot hold {n} fields")
    mask = (1 << bits) - 1
    # Byte-wide fields are cut from the words' bytes; others from the int64 words, where the arithmetic
    # shift of a negative word fills with ones and the mask removes them.
    source = words.contiguous().view(torch.uint8) if bits in _BYTE_FIELDS else words
    columns = 8 // bits if bits in _BYTE_FIELDS else per_word
    total = source.numel() * columns
    if out is None:
        out = torch.empty(total, dtype=dtype, device=words.device)
    elif out.dim() != 1 or out.numel() < total:
        raise ValueError(f"out must be a flat tensor of at least {total} entries; got shape {tuple(out.shape)}")
    if bits == 1 and _BYTE_FIELDS:
        zero = torch.zeros((), dtype=out.dtype, device=out.device)
        unpack_table(words, total, bit_table(zero, torch.ones_like(zero)), out=out[:total])
        return out[:n]
    grid = out[:total].view(source.numel(), columns)
    for j in range(columns):
        grid[:, j] = source.bitwise_right_shift(j * bits).bitwise_and_(mask)
    return out[:n]


def pack_flags_(flags: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``pack(flags, 1)`` of a flat bool or uint8 tensor of 0s and 1s, into ``out`` (``packed_words(n, 1)``
    int64 words) if given. ``flags`` is overwritten (it is scratch): one multiply and one shift per 8 flags,
    where ``pack`` takes a pass per bit. Little-endian machines only (``pack`` knows the others)."""
    n = flags.numel()
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
    """The lookup table of ``unpack_table``: ``(..., 256, 8)`` with entry ``[..., v, j]`` equal to ``one``
    where bit j of the byte v is set and ``zero`` where not. ``zero`` and ``one`` are tensors of shape
    ``(..., 1, 1)`` or ``(..., 1, 8)`` (a value per bit position), or 0-d; the table takes their dtype."""
    key = str(one.device)
    pattern = _PATTERNS.get(key)
    if pattern is None:
        pattern = _PATTERNS[key] = (torch.arange(256, device=one.device)[:, None]
                                    .bitwise_right_shift(torch.arange(8, device=one.device)).bitwise_and_(1).bool())
    return torch.where(pattern, one, zero)


def unpack_table(words: torch.Tensor, n: int, table: torch.Tensor, out: torch.Tensor | None = None,
                 base: torch.Tensor | None = None) -> torch.Tensor:
    """The ``n`` one-bit fields of the flat int64 ``words`` decoded through ``table`` (``(rows, 8)``, as
    ``bit_table`` builds): entry i is ``table[byte, i % 8]`` for the byte ``byte`` holding bit i, plus
    ``base[i // 8]`` where ``base`` (int32, one per byte) picks one of several stacked 256-row tables.
    Written into ``out`` (flat, ``n`` entries of the table's dtype) if given, which is returned."""
    if words.numel() * WORD_BITS < n:
        raise ValueError(f"{words.numel()} words of {WORD_BITS} fields cannot hold {n} fields")
    if out is None:
        out = torch.empty(n, dtype=table.dtype, device=table.device)
    source = words.contiguous().view(torch.uint8)
    whole = n // 8
    index = torch.empty(min(_CHUNK_BYTES, whole + 1), dtype=torch.int32, device=words.device)
    for start in range(0, whole, _CHUNK_BYTES):
        stop = min(start + _CHUNK_BYTES, whole)
        chunk = index[:stop - start].copy_(source[start:stop])
        if base is not None:
            chunk.add_(base[start:stop])
        torch.index_select(table, 0, chunk, out=out[start * 8:stop * 8].view(-1, 8))
    if n > whole * 8:
        last = index[:1].copy_(source[whole:whole + 1])
        if base is not None:
            last.add_(base[whole:whole + 1])
        out[whole * 8:].copy_(torch.index_select(table, 0, last)[0, :n - whole * 8])
    return out
