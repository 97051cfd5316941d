"""gTop-k's schedule (Shi et al., ICDCS 2019; docs/algorithms.md §7.3): a binomial tree that merges
pairs of top-k sets, keeping the top k of each merge, then a binomial broadcast of rank 0's set. 2 ceil(log2 P)
rounds; every rank sends at most one k-entry message in the merge and at most ceil(log2 P) in the broadcast."""
from __future__ import annotations

import torch

from gcomp.collectives.p2p import Program, Round, message_nbytes, pack, unpack
from gcomp.collectives.sparse_wire import SparseWire


def merge_top(index_a: torch.Tensor, values_a: torch.Tensor, index_b: torch.Tensor, values_b: torch.Tensor,
              k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top ``k`` (by magnitude) of two sparse vectors summed, each given by ``k`` distinct positions.

    Sorting puts a position both hold next to itself (a's entry first, so every rank adds a + b); the
    second of such a pair scores -1, below every magnitude, so the ``k`` kept positions are distinct.
    """
    index = torch.cat([index_a, index_b])
    order = torch.argsort(index, stable=True)
    index, values = index[order], torch.cat([values_a, values_b])[order]
    twin = index[1:] == index[:-1]  # entry i and i + 1 are the same position
    summed = values.clone()
    summed[:-1] += torch.where(twin, values[1:], 0)
    score = summed.abs()
    score[1:] = torch.where(twin, -1, score[1:])
    keep = torch.topk(score, k, sorted=False).indices
    return index[keep], summed[keep]


def gtopk_program(index: torch.Tensor, values: torch.Tensor, rank: int, world: int, n: int | None = None,
                  wire: SparseWire = SparseWire()) -> Program:
    """One rank's gTop-k rounds for its local top-k (``index`` int32 or int64 positions into ``n`` entries,
    ``values``); returns the global ``(index, values)`` every rank ends with (rank 0's last merge). Messages as
    ``wire`` makes them (``gcomp.collectives.sparse_wire``): the broadcast forwards rank 0's message as it is,
    and every rank, rank 0 too, ends with that message decoded, so all hold the same bits."""
    k = index.numel()
    sections = wire.sections(n if n is not None else 2**31 - 1, k, 1, values.dtype) if not wire.plain else \
        [(index.dtype, k), (values.dtype, k)]
    nbytes = message_nbytes(sections)

    def encoded(index, values):
        return pack([index, values]) if wire.plain else pack(wire.encode(index[None], values[None], n)[0])

    def decoded(message):
        if wire.plain:
            return tuple(t.clone() for t in unpack(message, sections))
        found, got = wire.decode(unpack(message, sections), n, k, 1, values.dtype)
        return found[0].to(index.dtype), got[0]

    gap = 1
    while gap < world:  # merge up the tree: rank r + gap hands its set to r
        if rank % (2 * gap) == gap:
            yield Round({rank - gap: encoded(index, values)})
        elif rank % (2 * gap) == 0 and rank + gap < world:
            got = yield Round(recvs={rank + gap: nbytes})
            other_index, other_values = decoded(got[rank + gap])
            index, values = merge_top(index, values, other_index, other_values, k)
        else:
            yield Round()
        gap *= 2
    message = encoded(index, values) if rank == 0 and not wire.plain else None
    if message is not None:  # rank 0 keeps what the others will decode
        index, values = decoded(message)
    while gap > 1:  # broadcast down the same tree
        gap //= 2
        if rank % (2 * gap) == 0 and rank + gap < world:
            yield Round({rank + gap: message if message is not None else pack([index, values])})
        elif rank % (2 * gap) == gap:
            got = yield Round(recvs={rank - gap: nbytes})
            message = got[rank - gap]
            index, values = decoded(message)
        else:
            yield Round()
    return index, values
