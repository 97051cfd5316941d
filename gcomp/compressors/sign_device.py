"""The device path of the sign family (``signsgd``, ``signum``, ``efsignsgd``) and of ``onebit``'s bits: the encode
and the decodes in a bounded number of kernels, whatever the bucket's size or number of parameters, and no host
synchronisation. The wire is the CPU path's (``gcomp.compressors.sign``): entry i at bit i % 64 of word i // 64.

- Pack: one comparison and ``bitpack.pack_flags_`` (bucket-wide already: 8 flags per int64 multiply).
- Scale ``mean|x|``: the layout-free row sums of ``sign_rows.AlignedRows``, one reduction for every row.
- Decode: each byte of the words picks its 8 decoded values from a 256-row table in one ``index_select`` over the
  whole bucket (``bitpack.unpack_table`` does it 64 K bytes at a time, for the CPU's caches).
- Sums over ranks (the mean of decodes, the majority vote): one ``embedding_bag`` over the gathered bytes, each
  byte's bag holding that byte of every rank, each rank's byte pointing into that rank's table. No tensor of a
  rank's decoded bucket is made: the kernel adds the ranks' table rows in rank order, as the CPU path's loop.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from gcomp.collectives import bitpack
from gcomp.compressors.sign_rows import AlignedRows

# Ranks summed by one embedding_bag: its index (and the kernel's own offset2bag) take 8 bytes per rank per byte of
# sign bits, so one group costs at most 8x the fp32 result; and their tables (8 KiB per rank and table) at most
# TABLE_BUDGET bytes. More ranks than that go in groups, added up in turn.
RANK_GROUP = 32
TABLE_BUDGET = 1 << 25
_PLUS_MINUS: dict[str, torch.Tensor] = {}
_OFFSETS: dict[tuple, torch.Tensor] = {}


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """``sign.pack_signs`` in one pass: 1 for ``x >= 0`` (zeros), 0 for ``x < 0`` and NaN, 64 to an int64 word."""
    return bitpack.pack_flags_(torch.ge(x.reshape(-1), 0))


def mean_magnitude(x: torch.Tensor, rows: AlignedRows) -> torch.Tensor:
    """``mean(|x|)`` as one fp32 number (shape (1,)): fp32 sums (fp64 for fp64) of ``rows.row`` entries of each
    parameter from its own start, added in float64 in the order of the parameters' names, rounded once; bit for
    bit the same whatever the layout (``sign_rows``)."""
    work = torch.promote_types(x.dtype, torch.float32)
    sums = rows.gather(x.reshape(-1)).abs_().sum(-1, dtype=work)
    return sums.sum(dtype=torch.float64).div_(max(x.numel(), 1)).to(torch.float32).reshape(1)


def _bytes(words: torch.Tensor, n: int) -> torch.Tensor:
    """The bytes of the words (the last dimension) that hold the first ``n`` bits."""
    return words.view(torch.uint8)[..., :-(-n // 8)]


def decode_one(words: torch.Tensor, n: int, table: torch.Tensor, base: torch.Tensor | None = None) -> torch.Tensor:
    """The ``n`` bits of the flat ``words`` decoded through ``table`` (``(rows, 8)``, ``bitpack.bit_table``'s
    layout, stacked 256-row tables picked per byte by ``base`` (int32, class * 256) if given), as ``unpack_table``
    does, in one ``index_select``: ``n`` entries of the table's dtype."""
    index = _bytes(words.reshape(-1), n).to(torch.int32)
    if base is not None:
        index.add_(base)
    return torch.index_select(table, 0, index).view(-1)[:n]


def _rank_offsets(count: int, stride: int, device) -> torch.Tensor:
    """``[0, stride, 2 * stride, ...]`` (int32, ``count`` of them), kept per device."""
    key = (count, stride, str(device))
    found = _OFFSETS.get(key)
    if found is None:
        found = _OFFSETS[key] = torch.arange(0, count * stride, stride, dtype=torch.int32, device=device)
    return found


def sum_decodes(words: torch.Tensor, n: int, tables: Callable[[int, int], torch.Tensor], classes: int = 1,
                base: torch.Tensor | None = None, shared: bool = False) -> torch.Tensor:
    """The sum over ranks (rank order, fp32) of each rank's ``n`` bits of ``words`` (``(world, words)``) decoded
    through its own tables: ``tables(a, b)`` gives those of ranks a to b - 1, ``(b - a, classes, 256, 8)`` fp32
    (``shared``: ``(classes, 256, 8)``, every rank's), a byte of class c (``base``: int32, c * 256 per byte; class
    0 for all without it) looking up table c."""
    world = words.shape[0]
    data = _bytes(words, n)  # (world, bytes)
    per_rank = 0 if shared else classes * 256
    group = max(1, min(RANK_GROUP, TABLE_BUDGET // (classes * 256 * 8 * 4)))
    total = None
    for start in range(0, world, group):  # one turn up to RANK_GROUP ranks (and tables within TABLE_BUDGET)
        stop = min(start + group, world)
        index = torch.empty((data.shape[1], stop - start), dtype=torch.int32, device=words.device)
        ranks, offsets = data[start:stop].t(), base[:, None] if base is not None else None
        if per_rank:
            ranks_at = _rank_offsets(stop - start, per_rank, words.device)
            offsets = ranks_at if offsets is None else offsets + ranks_at  # (bytes, ranks) int32
        if offsets is None:
            index.copy_(ranks)
        else:
            torch.add(ranks, offsets, out=index)
        part = F.embedding_bag(index, tables(start, stop).reshape(-1, 8), mode="sum")
        total = part if total is None else total.add_(part)
    return total.view(-1)[:n]


def plus_minus(device) -> torch.Tensor:
    """The ``(256, 8)`` fp32 table of +1 for a set bit and -1 for a clear one, kept per device."""
    key = str(device)
    table = _PLUS_MINUS.get(key)
    if table is None:
        one = torch.ones((), device=device)
        table = _PLUS_MINUS[key] = bitpack.bit_table(-one, one)
    return table


def decode(words: torch.Tensor, n: int, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One rank's payload: ``+scale`` where the bit is 1, ``-scale`` where it is 0 (``dtype``, ``n`` entries)."""
    scale = scale.reshape(1, 1)
    return decode_one(words, n, bitpack.bit_table(-scale, scale).to(dtype))


def aggregate(words: torch.Tensor, scales: torch.Tensor, n: int, dtype: torch.dtype, rule: str) -> torch.Tensor:
    """Every rank's payload (``(world, words)`` int64, ``(world, 1)`` fp32) combined by ``rule``: ``"mean"``, the
    fp32 sum of the decodes in rank order; ``"majority"``, the summed scales times the sign of the vote."""
    world = words.shape[0]
    if world == 1:  # one rank's vote is its sign: both rules decode its payload
        return decode(words[0], n, scales[0], dtype)
    if rule == "majority":  # (#plus - #minus) per entry, exact in fp32: its sign is the vote, ties 0
        table = plus_minus(words.device)
        votes = sum_decodes(words, n, lambda a, b: table, shared=True)
        return votes.sign_().mul_(scales.sum()).to(dtype)
    scales = scales.reshape(world, 1, 1, 1)
    total = sum_decodes(words, n, lambda a, b: bitpack.bit_table(-scales[a:b], scales[a:b]))
    return total.to(dtype)
