"""PacTrain's support under FSDP2: the entries each destination shard keeps, packed into equal-size rows."""
from __future__ import annotations

import torch

from gcomp.fsdp.layout import ShardLayout
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
