"""``gtopk``: global top-k (Shi et al., ICDCS 2019), the tree-merge baseline SparDL is compared with."""
from __future__ import annotations

from typing import Annotated

import torch

from gcomp.bucket import index_dtype
from gcomp.collectives.gtopk import gtopk_program
from gcomp.collectives.narrow_values import narrow
from gcomp.collectives.scheduled import ProgramCommunicator, ScheduledCompressor, ScheduledCtx
from gcomp.collectives.sparse_wire import SparseWire
from gcomp.compressors.sparse import PositionsParam, ValuesParam, check_wire
from gcomp.memory import NoMemory
from gcomp.method import Method
from gcomp.params import Range
from gcomp.registry import register


class GlobalTopKCompressor(ScheduledCompressor):
    """Each rank takes the top k = max(1, int(density * n)) of its compensated bucket; a binomial tree merges
    the sets pairwise, summing shared positions and keeping the top k each time, and rank 0's result is
    broadcast down the same tree (``gcomp.collectives.gtopk``).

    On the wire, point-to-point only: messages of k (int32 position, int64 past 2**31 entries; value in the
    bucket's dtype) pairs; 2 ceil(log2 P) rounds; a rank sends one message up the tree (rank 0 none) and one
    per child down it.

    Error feedback: a rank's entries count as sent where its local choice is in the global set; everything
    else stays in its residual. As in the paper, a value a merge dropped is lost where its position still
    made the global set through another branch of the tree. With narrow values a rank keeps its own entries'
    rounding error (as its first message rounds them); a merge's sum rounded again up the tree loses its own.
    """

    def __init__(self, density: float, positions: str = "raw", values: str = "fp32"):
        super().__init__()
        self.density = density
        self.wire = SparseWire(*check_wire(positions, values))

    def program(self, ctx: ScheduledCtx, rank: int, world: int, keep: bool = True):
        compensated = ctx.compensated
        n = compensated.numel()
        k = max(1, int(n * self.density))
        local = torch.topk(compensated.abs(), k, sorted=False).indices  # NaN and infinities first
        index, values = yield from gtopk_program(local.to(index_dtype(n)), compensated[local], rank, world, n,
                                                 self.wire)
        index = index.long()
        if keep:
            residual = compensated.clone()
            mine = compensated[local]
            left = 0 if self.wire.values == "fp32" else mine - narrow(mine, self.wire.values)[2]
            # both sets are distinct positions: without assume_unique, isin runs unique on each, a host sync on a GPU
            residual[local] = torch.where(torch.isin(local, index, assume_unique=True), left, mine)
            self.memory.store(residual, ctx.bucket)
        return torch.zeros_like(compensated).index_add_(0, index, values)  # positions are distinct


@register("gtopk", paper="Shi et al., A Distributed Synchronous SGD Algorithm with Global Top-k Sparsification, "
                         "ICDCS 2019")
def gtopk(density: Annotated[float, Range(0, 1, low_open=True), "fraction of the bucket's entries sent"] = 0.01,
          positions: PositionsParam = "coded", values: ValuesParam = "fp32") -> Method:
    """Global top-k: pairwise tree merge with re-selection, then a tree broadcast; point-to-point messages."""
    return Method(GlobalTopKCompressor(density, positions, values), NoMemory(), ProgramCommunicator())
