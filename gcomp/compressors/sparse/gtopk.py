"""``gtopk``: global top-k (Shi et al., ICDCS 2019), the tree-merge baseline SparDL is compared with
(docs/algorithms.md §7.3)."""
from __future__ import annotations

import torch

from gcomp.collectives.program import Program, ProgramCtx, Round, ScheduledCompressor, message_nbytes, pack, unpack
from gcomp.collectives.sparse_wire import SparseWire, narrow
from gcomp.core import POINT_TO_POINT, Traits


def merge_top(index_a: torch.Tensor, values_a: torch.Tensor, index_b: torch.Tensor, values_b: torch.Tensor,
              k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top ``k`` (by magnitude) of two sparse vectors summed, each given by ``k`` distinct positions. Sorting puts
    a position both hold next to itself (a's entry first, so every rank adds a + b); the second of such a pair scores
    -1, below every magnitude, so the ``k`` kept positions are distinct."""
    index = torch.cat([index_a, index_b])
    order = torch.argsort(index, stable=True)
    index, values = index[order], torch.cat([values_a, values_b])[order]
    twin = index[1:] == index[:-1]
    summed = values.clone()
    summed[:-1] += torch.where(twin, values[1:], 0)
    score = summed.abs()
    score[1:] = torch.where(twin, -1, score[1:])
    keep = torch.topk(score, k, sorted=False).indices
    return index[keep], summed[keep]


def tree_program(index: torch.Tensor, values: torch.Tensor, rank: int, world: int, n: int,
                 wire: SparseWire = SparseWire()) -> Program:
    """One rank's gTop-k rounds for its local top k (``index``: positions into ``n`` entries, ``values``): a binomial
    tree merges pairs of sets (``merge_top``), then rank 0's set is broadcast down the same tree; 2 ceil(log2 P)
    rounds. Returns the global int64 ``(index, values)``. Messages as ``wire`` makes them; the broadcast forwards rank
    0's message as it is and every rank, rank 0 too, ends with it decoded, so all hold the same bits."""
    k = index.numel()
    sections = wire.sections(n, k, values.dtype)

    def decoded(message):
        found, got = wire.decode(unpack(message, sections), n, k, values.dtype)
        return found.view(k), got.view(k)

    gap = 1
    while gap < world:  # merge up the tree: rank r + gap hands its set to r
        if rank % (2 * gap) == gap:
            yield Round({rank - gap: pack(wire.encode(index[None], values[None], n)[0])})
        elif rank % (2 * gap) == 0 and rank + gap < world:
            got = yield Round(recvs={rank + gap: message_nbytes(sections)})
            index, values = merge_top(index, values, *decoded(got[rank + gap]), k)
        else:
            yield Round()
        gap *= 2
    message = pack(wire.encode(index[None], values[None], n)[0]) if rank == 0 else None
    if message is not None:  # rank 0 keeps what the others will decode
        index, values = decoded(message)
    while gap > 1:  # broadcast down the same tree
        gap //= 2
        if rank % (2 * gap) == 0 and rank + gap < world:
            yield Round({rank + gap: message})
        elif rank % (2 * gap) == gap:
            got = yield Round(recvs={rank - gap: message_nbytes(sections)})
            message = got[rank - gap]
            index, values = decoded(message)
        else:
            yield Round()
    return index, values


class GlobalTopKCompressor(ScheduledCompressor):
    """Each rank takes the top ``k = max(1, int(density * n))`` of its compensated bucket, and ``tree_program``
    reduces them to one global set of k. On the wire, point-to-point only: messages of k values and positions
    (``gcomp.collectives.sparse_wire``); a rank sends one message up the tree (rank 0 none) and one per child down it.

    Error feedback (the ``residuals`` slot): a rank's entries count as sent where its local choice is in the global
    set; everything else stays. As in the paper, a value a merge dropped is lost where its position still made the
    global set through another branch. With narrow values a rank keeps its own entries' rounding error; a merge's sum
    rounded again up the tree loses its own."""

    def __init__(self, density: float, positions: str = "raw", values: str = "fp32"):
        self.density = density
        self.wire = SparseWire(positions, values)
        self.traits = Traits(POINT_TO_POINT, self.wire.fidelity, slots=("residuals",), held=("residuals",), rows=None,
                             decodes_alone=False)

    def program(self, ctx: ProgramCtx, rank: int, world: int, keep: bool = True):
        x = ctx.compensated.reshape(-1)
        n = x.numel()
        local = torch.topk(x.abs(), max(1, int(n * self.density)), sorted=False).indices  # NaN and infinities first
        mine = x[local]
        index, values = yield from tree_program(local, mine, rank, world, n, self.wire)
        if keep:
            # both sets are distinct positions: without assume_unique, isin runs unique on each, a host sync on a GPU
            sent = torch.isin(local, index, assume_unique=True)
            left = torch.where(sent, mine - narrow(mine, self.wire.values)[2], mine)
            residual = ctx.state["residuals"].view(-1).copy_(x).index_copy_(0, local, left)
            torch.nan_to_num_(residual, nan=0.0, posinf=0.0, neginf=0.0)
        return torch.zeros_like(x).index_add_(0, index, values)  # positions are distinct
