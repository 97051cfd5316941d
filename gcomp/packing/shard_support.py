"""PacTrain's support under FSDP2: the entries each destination shard keeps, packed into equal-size rows."""
from __future__ import annotations

from functools import cached_property

import torch

from gcomp.collectives import bitpack
from gcomp.packing import lanes
from gcomp.sharding.layout import ShardLayout
from gcomp.packing.support import Support
from gcomp.pruning.masks import positions_digest


class ShardSupport(Support):
    """The kept entries of FSDP's reduce-scatter input, row by row: row r (what shard r receives) keeps K_r
    entries, the kept entries of its chunk of every parameter (a parameter without a mask keeps all; FSDP's dim-0
    padding keeps none). Packed, every row holds K = max_r K_r entries, its own first, in input order, then zeros:
    ``kept`` = world * K, padding included (what goes on the wire, and what ``dense_above`` compares).

    Positions are one int64 index of shape (world, K) (``torch.gather`` takes no int32): 8 bytes per packed entry.
    """

    def __init__(self, layout: ShardLayout, masks: list[torch.Tensor | None], device: torch.device | str):
        rows = layout.shard_major([None if m is None else m != 0 for m in masks], True, False, torch.bool, device)
        counts = rows.sum(1)
        self.layout = layout
        self.width = int(counts.max()) if counts.numel() else 0
        self.numel = rows.numel()
        self.kept = layout.world * self.width
        self.counts = tuple(counts.tolist())
        self.segments = (self.kept,)
        self.digest = positions_digest(rows.reshape(-1).nonzero().reshape(-1))
        # kept positions first, in order (a stable sort of "not kept"), then positions that are not kept
        order = torch.sort((~rows).to(torch.uint8), dim=1, stable=True).indices[:, :self.width]
        self.index = order.contiguous()
        self.valid = torch.arange(self.width, device=device)[None, :] < counts[:, None]
        self.own = self.index[layout.rank, :self.counts[layout.rank]].contiguous()

    @property
    def index_bytes(self) -> int:
        return self.index.numel() * self.index.element_size() + self.own.numel() * 8

    @cached_property
    def ternary(self) -> "TernaryRows":
        """The orders PacTrain's ternary codec needs on this support (built at its first ternary step)."""
        return TernaryRows(self)

    def pack(self, input: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out[:, :K]`` (``out``: (world, K + extra)) = each row's kept entries of ``input``, then zeros."""
        rows = input.view(self.layout.world, -1)
        out[:, :self.width].copy_(torch.gather(rows, 1, self.index)).masked_fill_(~self.valid, 0)
        return out

    def unpack_own(self, row: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        """Write this rank's reduced row (``row[:K_rank]``) onto its kept entries of ``output``, zero elsewhere."""
        return output.zero_().index_copy_(0, self.own, row[:self.own.numel()])

    def gather(self, bucket: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        self.pack(bucket, out[:self.kept].view(self.layout.world, self.width))
        return out

    def scatter(self, packed: torch.Tensor, bucket: torch.Tensor) -> torch.Tensor:
        values = packed[:self.kept].view(self.layout.world, self.width).masked_fill(~self.valid, 0)
        bucket.zero_().view(self.layout.world, -1).scatter_(1, self.index, values)
        return bucket


class _Values(Support):
    """The face ``TernaryCodec`` (``gcomp.compressors.pactrain_ternary``) reads of a support: ``kept`` values in
    per-parameter ``segments`` (one shared scale each), gathered from the input by ``index``."""

    def __init__(self, kept: int, segments: tuple[int, ...], index: torch.Tensor | None, digest: torch.Tensor):
        self.numel, self.kept, self.segments, self.index, self.digest = kept, kept, segments, index, digest

    @property
    def index_bytes(self) -> int:
        return 0 if self.index is None else self.index.numel() * 8

    def gather(self, bucket: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        torch.index_select(bucket, 0, self.index, out=out[:self.kept])
        return out

    def scatter(self, packed: torch.Tensor, bucket: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("the ternary rows decode onto this rank's shard only (ShardSupport.unpack_own)")


class TernaryRows:
    """PacTrain's ternary codec on a ``ShardSupport``: the kept entries of the whole input as ``values``, parameter
    by parameter (each parameter's kept entries in its own order: what DDP's ternary path gathers from a bucket,
    so one scale per parameter, as there), and where each one's code goes on the wire: a ``(world, F)`` matrix of
    lane fields, row r the K_r codes of destination shard r in row order (``ShardSupport``'s), zero-padded to
    ``F = words * fields_per_word(bits)``, ``words = packed_words(K, bits)`` and ``bits = lane_bits(world)``, so
    that each row packs into ``words`` whole int64 words and a reduce-scatter cuts the lanes between rows. ``own``
    is this rank's row as the decode reads it: K_rank values, in per-parameter segments."""

    def __init__(self, support: ShardSupport):
        layout = support.layout
        world, rank = layout.world, layout.rank
        kept = torch.zeros(world, layout.shard_numel, dtype=torch.bool, device=support.index.device)
        kept.scatter_(1, support.index, support.valid)
        column = kept.cumsum(1).sub_(1)  # a kept entry's place in its packed row
        self.bits = bitpack.lane_bits(world)
        self.words = bitpack.packed_words(support.width, self.bits)
        self.fields = self.words * bitpack.fields_per_word(self.bits)
        index, dest, totals, own, at = [], [], [], [], 0
        for chunk in layout.chunks:  # a loop over parameters, not entries
            rows, cols = kept[:, at:at + chunk].nonzero(as_tuple=True)  # row by row: the parameter's own order
            index.append(rows * layout.shard_numel + at + cols)
            dest.append(rows * self.fields + column[rows, at + cols])
            totals.append(rows.numel())
            own.append(int(kept[rank, at:at + chunk].sum()))
            at += chunk
        device = support.index.device
        cat = (lambda parts: torch.cat(parts)) if index else (lambda parts: torch.zeros(0, dtype=torch.int64,
                                                                                       device=device))
        self.values = _Values(sum(totals), tuple(totals), cat(index), support.digest)
        self.dest = cat(dest)  # flat position in the (world, fields) code matrix of each value's code
        self.own = _Values(sum(own), tuple(own), None, support.digest)
        self.world = world

    def rows(self, codes: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Lay the values' codes (``codes[:values.kept]``, uint8) into ``out`` ((world, fields) uint8, zero where
        no code goes: the padding fields stay as allocated) and pack it: ``(world, words)`` int64."""
        out.view(-1).index_copy_(0, self.dest, codes[:self.values.kept])
        return lanes.pack(out.view(-1), self.bits).view(self.world, self.words)
