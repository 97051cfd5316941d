"""Bit packing into int64 words: k-bit codes for all-gather, and integer lanes that survive a SUM all-reduce.

A value in ``[0, 2**bits)`` goes into a ``bits``-wide field; ``64 // bits`` fields share one int64 word.
Summing packed words over N ranks sums every field at once, and no carry crosses into the next field as
long as each field's sum stays below ``2**bits``; ``lane_bits(N, max_value)`` picks that width. gloo and
NCCL both sum int64 (gloo has no int16), and a SUM that runs into the sign bit wraps modulo 2**64, which
leaves every field intact: the top field may use the sign bit.
"""
from __future__ import annotations

import sys

import torch

WORD_BITS = 64
# Fields that tile a byte (1, 2, 4, 8 bits) are packed byte by byte: uint8 passes instead of int64 ones.
# Field j of a word then sits in byte j * bits // 8, which is where the int64 layout puts it on a
# little-endian machine (every machine torch supports today); elsewhere the int64 path runs.
_BYTE_FIELDS = (1, 2, 4, 8) if sys.byteorder == "little" else ()


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
    grid = out[:total].view(source.numel(), columns)
    for j in range(columns):
        grid[:, j] = source.bitwise_right_shift(j * bits).bitwise_and_(mask)
    return out[:n]
