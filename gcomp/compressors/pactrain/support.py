"""What a pruned layout keeps (its support), built once from the masks when the mask tracker freezes it; the codec
reads its indices at every packed step.

- ``Support``: a DDP bucket's kept entries as one index in packed order (``bucket_support``): single entries in
  bucket order (``pactrain``), or whole filters and channels (``prunex``: ``group_dim``), each parameter's kept
  groups in logical order, so that structured pruning costs no more than its groups to find;
- ``ShardSupport``: FSDP2's reduce-scatter input, row by row (one per destination shard), each row's kept entries
  packed into equal rows; ``ShardSupport.ternary`` lays the ternary codes of the whole input into those rows.

Each parameter's kept entries are one contiguous segment of the packed values (``segments``): per-parameter
ternary scales rely on it. ``digest`` (int64 (hash, count) of the kept positions) is what ranks compare.
"""
from __future__ import annotations

from functools import cached_property

import torch

from gcomp.bucket import index_dtype
from gcomp.collectives import bitpack
from gcomp.pruning.masks import positions_digest
from gcomp.sharding import ShardLayout


class Support:
    """A bucket's kept entries: ``positions`` (int32 below 2**31 entries), ``segments`` (kept per parameter, in
    bucket order), ``numel`` and ``kept``. The ternary codec gathers its values and decodes them at ``positions``
    alike (``own``, ``own_segments``: the names ``ShardSupport.ternary`` gives its own row)."""

    def __init__(self, positions: torch.Tensor, numel: int, segments: tuple[int, ...]):
        self.positions = self.own = positions.to(index_dtype(numel))
        self.numel, self.segments, self.own_segments = numel, segments, segments
        self.kept = sum(segments)
        self.digest = positions_digest(positions)


def bucket_support(params: list[tuple[torch.Size, tuple[int, ...], torch.Tensor | None]], numel: int,
                   device, groups: bool = False) -> Support:
    """The support of a bucket from each parameter's size, strides and mask (None: kept whole), in bucket order.
    DDP lays each gradient into the bucket with the parameter's own strides (channels_last included), so a mask's
    entries are placed through a strided view of its slice. ``groups``: every filter or channel (``group_dim``)
    with a kept entry is kept whole."""
    pieces, start = [], 0
    for size, stride, mask in params:
        n = size.numel()
        place = torch.arange(start, start + n, device=device).as_strided(size, stride)  # bucket place of each entry
        if not groups:  # bucket order
            place = (place if mask is None else place[mask.to(device) != 0]).reshape(-1).sort().values
        elif mask is not None and n and not bool((mask != 0).all()):
            dim, kept = group_dim(mask.reshape(size).to(device))
            place = place.index_select(dim, kept.nonzero().reshape(-1))
        pieces.append(place.reshape(-1))
        start += n
    if start != numel:
        raise ValueError(f"the parameters cover {start} entries of a bucket of {numel}")
    return Support(torch.cat(pieces), numel, tuple(p.numel() for p in pieces))


def group_dim(mask: torch.Tensor) -> tuple[int, torch.Tensor]:
    """The dimension whose kept groups (slices ``[..., i, ...]`` with any nonzero entry) cover the fewest entries,
    and those groups as a bool vector; ties go to the lower dimension (filters)."""
    nonzero = mask != 0
    best = None
    for d in range(nonzero.dim()):
        others = [i for i in range(nonzero.dim()) if i != d]
        groups = nonzero.any(dim=others) if others else nonzero
        volume = int(groups.sum()) * (nonzero.numel() // max(nonzero.size(d), 1))
        if best is None or volume < best[0]:
            best = (volume, d, groups)
    return best[1], best[2]


class ShardSupport:
    """The kept entries of FSDP's reduce-scatter input, row by row: row r (what shard r receives) keeps K_r entries,
    those of its chunk of every parameter (a parameter without a mask keeps all; FSDP's dim-0 padding none). Packed,
    every row holds K = max_r K_r entries, its own first in input order, then zeros: ``kept`` = world * K (what goes
    on the wire and what ``dense_above`` compares). ``index`` (world, K) int64 (``torch.gather``'s), ``valid`` its
    real entries, ``own`` this rank's positions in its shard."""

    def __init__(self, layout: ShardLayout, masks: list[torch.Tensor | None], device):
        rows = layout.shard_major([None if m is None else m != 0 for m in masks], True, False, torch.bool, device)
        counts = rows.sum(1)
        self.layout, self.numel = layout, rows.numel()
        self.width = int(counts.max()) if counts.numel() else 0
        self.kept = layout.world * self.width
        self.digest = positions_digest(rows.reshape(-1).nonzero().reshape(-1))
        # kept positions first, in order (a stable sort of "not kept"), then the others
        self.index = torch.sort((~rows).to(torch.uint8), dim=1, stable=True).indices[:, :self.width].contiguous()
        self.valid = torch.arange(self.width, device=device)[None, :] < counts[:, None]
        self.own = self.index[layout.rank, :int(counts[layout.rank])].contiguous()

    @cached_property
    def ternary(self) -> "TernaryRows":
        return TernaryRows(self)


class TernaryRows:
    """The ternary codec on a ``ShardSupport``: the kept entries of the whole input as values (``positions``, into
    the flat input), parameter by parameter (``segments``: one shared scale each, as under DDP), and where each
    one's code goes: ``dest``, its place in a (world, ``fields``) matrix of lane fields, row r holding the K_r codes
    of shard r in ``ShardSupport``'s row order, zero-padded to ``fields = words * fields_per_word(bits)``, so that
    each row packs into ``words = packed_words(K, bits)`` int64 words and a reduce-scatter cuts the lanes between
    rows. ``own`` and ``own_segments``: this rank's row as its decode reads it (K_rank values, per parameter)."""

    def __init__(self, support: ShardSupport):
        layout = support.layout
        kept = torch.zeros(layout.world, layout.shard_numel, dtype=torch.bool, device=support.index.device)
        kept.scatter_(1, support.index, support.valid)
        column = kept.cumsum(1).sub_(1)  # a kept entry's place in its packed row
        self.bits = bitpack.lane_bits(layout.world)
        self.words = bitpack.packed_words(support.width, self.bits)
        self.fields = self.words * bitpack.fields_per_word(self.bits)
        index, dest, at = [], [], 0
        for chunk in layout.chunks:  # a loop over parameters, once per frozen support
            rows, cols = kept[:, at:at + chunk].nonzero(as_tuple=True)  # row by row: the parameter's own order
            index.append(rows * layout.shard_numel + at + cols)
            dest.append(rows * self.fields + column[rows, at + cols])
            at += chunk
        self.positions = torch.cat(index)
        self.dest = torch.cat(dest)
        self.segments = tuple(i.numel() for i in index)
        self.own, self.world = support.own, layout.world
        chunks = kept[layout.rank].split(list(layout.chunks))
        self.own_segments = tuple(int(c.sum()) for c in chunks)
