"""``gtopk``: global top-k (Shi et al., ICDCS 2019), the tree-merge baseline SparDL is compared with."""
from __future__ import annotations

from typing import Annotated

import torch

from gcomp.bucket import index_dtype
from gcomp.collectives.gtopk import gtopk_program
from gcomp.collectives.scheduled import ProgramCommunicator, ScheduledCompressor, ScheduledCtx
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
    made the global set through another branch of the tree.
    """

    def __init__(self, density: float):
        super().__init__()
        self.density = density

    def program(self, ctx: ScheduledCtx, rank: int, world: int, keep: bool = True):
        compensated = ctx.compensated
        n = compensated.numel()
        k = max(1, int(n * self.density))
        local = torch.topk(compensated.abs(), k, sorted=False).indices  # NaN and infinities first
        index, values = yield from gtopk_program(local.to(index_dtype(n)), compensated[local], rank, world)
        index = index.long()
        if keep:
            residual = compensated.clone()
            # both sets are distinct positions: without assume_unique, isin runs unique on each, a host sync on a GPU
            residual[local] = torch.where(torch.isin(local, index, assume_unique=True), 0, compensated[local])
            self.memory.store(residual, ctx.bucket)
        return torch.zeros_like(compensated).index_add_(0, index, values)  # positions are distinct


@register("gtopk", paper="Shi et al., A Distributed Synchronous SGD Algorithm with Global Top-k Sparsification, "
                         "ICDCS 2019")
def gtopk(density: Annotated[float, Range(0, 1, low_open=True), "fraction of the bucket's entries sent"] = 0.01
          ) -> Method:
    """Global top-k: pairwise tree merge with re-selection, then a tree broadcast; point-to-point messages."""
    return Method(GlobalTopKCompressor(density), NoMemory(), ProgramCommunicator())
