"""What the family's codecs share: the sign bits, a bucket copied in rows whose sums do not depend on DDP's order of
the parameters, and the sum over ranks of payloads decoded through per-byte lookup tables."""
from __future__ import annotations

from functools import lru_cache
from typing import Callable

import torch
import torch.nn.functional as F

from gcomp.bucket import BucketInfo
from gcomp.collectives import bitpack

ROW = 1 << 12  # entries per partial sum of ``rows_by_name``
# Ranks summed by one embedding_bag: its index (and the kernel's own offset2bag) take 8 bytes per rank per byte of
# sign bits, and their tables (8 KiB per rank and class) at most TABLE_BUDGET bytes. More go in turn.
RANK_GROUP = 32
TABLE_BUDGET = 1 << 25


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """1 for ``x >= 0`` (zeros of either sign), 0 for ``x < 0`` and NaN: entry i at bit i % 64 of int64 word i // 64,
    the padding bits zero."""
    return bitpack.pack_flags_(torch.ge(x.reshape(-1), 0))


@lru_cache(maxsize=256)
def by_name(layout: BucketInfo, n: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """The sizes of ``layout``'s parameters in bucket order (one segment when it does not describe ``n`` entries),
    their indices in the order of their names, the rows of ``ROW`` each takes in that order, and each one's place in
    it."""
    parts = list(layout.segments()) if layout.numel == n and layout.numels else [("", 0, n)]
    order = tuple(sorted(range(len(parts)), key=lambda j: parts[j]))
    sizes, place = tuple(k for _, _, k in parts), tuple(sorted(range(len(order)), key=order.__getitem__))
    return sizes, order, tuple(-(-sizes[j] // ROW) for j in order), place


def rows_by_name(x: torch.Tensor, layout: BucketInfo) -> torch.Tensor:
    """``x`` copied as ``(rows, ROW)``: each parameter from the start of a row, in the order of their names, its last
    row closed by zeros. The copy is the same whatever the layout, so a reduction over its rows, and any fixed-order
    sum of those, is bit for bit the same on every layout (a resumed run starts on DDP's first one)."""
    sizes, order, rows, _ = by_name(layout, x.numel())
    pads = [r * ROW - sizes[j] for j, r in zip(order, rows)]
    pieces, zeros = x.reshape(-1).split(sizes), x.new_zeros(sum(pads)).split(pads)
    return torch.cat([t for j, pad in zip(order, zeros) for t in (pieces[j], pad)]).view(-1, ROW)


def sum_decodes(words: torch.Tensor, n: int, tables: Callable[[int, int], torch.Tensor], classes: int = 1,
                base: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 sum in rank order of each rank's ``n`` bits of ``words`` (``(world, words)``) decoded through its own
    tables: ``tables(a, b)``, those of ranks a to b - 1, ``(b - a, classes, 256, 8)`` (``bitpack.bit_table``'s); a
    byte of class c (``base``: int32, c * 256 per byte; class 0 without) looks up table c. One embedding_bag per group
    of ranks, each byte's bag holding that byte of every rank: no rank's decoded bucket is made."""
    world, count = words.shape[0], -(-n // 8)
    data = bitpack.word_bytes(words.reshape(-1), words.numel() * 8).view(world, -1)[:, :count].t()
    group, total = max(1, min(RANK_GROUP, TABLE_BUDGET // (classes * 256 * 8 * 4))), None
    for a in range(0, world, group):
        b = min(a + group, world)
        index = torch.empty((count, b - a), dtype=torch.int32, device=words.device)
        torch.add(data[:, a:b], torch.arange(0, (b - a) * classes * 256, classes * 256, dtype=torch.int32,
                                             device=words.device), out=index)
        if base is not None:
            index.add_(base[:, None])
        part = F.embedding_bag(index, tables(a, b).reshape(-1, 8), mode="sum")
        total = part if total is None else total.add_(part)
    return total.view(-1)[:n]
