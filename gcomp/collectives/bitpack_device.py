"""Bit fields on the device path (``gcomp.kernels.on_device``): ``gcomp.collectives.bitpack``'s ``pack`` and ``unpack``
with the same layout (field
j of word w holds entry ``w * (64 // bits) + j``), and byte-table decodes, each a fixed handful of operations
whatever the bucket's size and the field width.

``bitpack`` takes one pass per field of a word (up to 63) and its table decode one gather per 64 K bytes: cheap on
one CPU thread, a launch each on a device. Here the fields of every word are placed by one broadcast shift of an
int64 ``(words, fields)`` grid and summed (their bits are disjoint: the sum is their OR, and a top field in the sign
bit wraps as it should), or cut out of it by one shift and one mask; the grid costs 8 bytes per entry while the
call runs. A table decode gathers rows of a small table by every byte of the words at once.
"""
from __future__ import annotations

import torch

from gcomp.collectives import bitpack

_SHIFTS: dict[tuple[int, str], torch.Tensor] = {}


def shifts(bits: int, device: torch.device) -> torch.Tensor:
    """``j * bits`` for the fields j of a word, int64 on ``device`` (kept per width and device)."""
    key = (bits, str(device))
    found = _SHIFTS.get(key)
    if found is None:
        found = _SHIFTS[key] = torch.arange(bitpack.fields_per_word(bits), dtype=torch.int64).mul_(bits).to(device)
    return found


def pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """``bitpack.pack(values, bits)``: the flat integer ``values`` in ``[0, 2**bits)`` as int64 words."""
    per_word = bitpack.fields_per_word(bits)
    n = values.numel()
    words = -(-n // per_word)
    grid = torch.empty(words * per_word, dtype=torch.int64, device=values.device)
    grid[:n].copy_(values.reshape(-1))
    if n < grid.numel():
        grid[n:].zero_()
    return grid.view(words, per_word).bitwise_left_shift_(shifts(bits, values.device)).sum(1)


def unpack(words: torch.Tensor, n: int, bits: int, dtype: torch.dtype = torch.int64,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """``bitpack.unpack(words, n, bits)``: the first ``n`` fields of the flat int64 ``words`` (their values, or their
    sums over ranks after an all-reduce), as ``dtype``, written into ``out[:n]`` if given."""
    if words.numel() * bitpack.fields_per_word(bits) < n:
        raise ValueError(f"{words.numel()} words of {bitpack.fields_per_word(bits)} fields cannot hold {n} fields")
    # an arithmetic shift of a negative word fills with ones: the mask removes them
    grid = words.reshape(-1, 1).bitwise_right_shift(shifts(bits, words.device)).bitwise_and_((1 << bits) - 1)
    fields = grid.view(-1)[:n]
    if out is None:
        return fields.to(dtype)
    return out[:n].copy_(fields)


def table_decode(words: torch.Tensor, rows: int, table: torch.Tensor, out: torch.Tensor,
                 index: torch.Tensor) -> torch.Tensor:
    """The first ``rows`` bytes of the flat ``words`` decoded through ``table`` (``(256, k)``: row v holds the k
    values of the byte v) into ``out``, a flat buffer of at least ``rows * k`` entries of the table's dtype, by one
    gather; ``index`` is an int32 buffer of at least ``rows`` entries. Returns ``out[:rows * k]``."""
    source = words.contiguous().view(torch.uint8)[:rows]
    chosen = index[:rows].copy_(source)
    k = table.shape[1]
    return torch.index_select(table, 0, chosen, out=out[:rows * k].view(rows, k)).view(-1)
