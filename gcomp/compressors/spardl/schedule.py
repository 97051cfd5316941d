"""SparDL's schedules (docs/algorithms.md §7.2): Spar-Reduce-Scatter, Spar-All-Gather and the Bruck all-gather, as
round programs (``gcomp.collectives.program``: one message per peer per round, of a size both sides know).

With P workers in ``teams`` teams of Q = P / teams, the bucket (zero-padded to Q * B) is cut into Q blocks of B
entries; block j belongs to team member j. One step, on one rank (team t, member q):

1. Spar-Reduce-Scatter inside the team (``reduce_scatter_rounds``: ceil(log2 Q) rounds, any Q): every block but q is
   sent once, as the top k of what has accumulated in it, to the member that takes it on; what arrives for a block is
   added to it. Block q ends up holding the team's (sparsified) sum.
2. The top h of block q is chosen. With several teams, Spar-All-Gather exchanges it (a Bruck all-gather over the
   members q of every team), and the union of the teams' choices, summed, is cut back to its top k.
3. A Bruck all-gather inside the team gives every rank every block's final choice.

The provisional residual is what stays in the blocks: each block's accumulated sum with the sent entries zeroed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gcomp.bucket import index_dtype
from gcomp.collectives.program import Program, Round, message_nbytes, pack, unpack
from gcomp.collectives.sparse_wire import SparseWire, narrow


def reduce_scatter_rounds(size: int) -> list[tuple[int, int]]:
    """``(gap, count)`` per round of the non-recursive Spar-Reduce-Scatter among ``size`` members: member q sends its
    blocks q+gap .. q+gap+count-1 to member q+gap and receives blocks q .. q+count-1 from member q-gap (mod
    ``size``). The first round moves the ``size - 2**(r-1)`` blocks a power of two cannot cover; the others halve the
    gap. ceil(log2 size) rounds, size - 1 blocks in all."""
    if size < 1:
        raise ValueError(f"a team needs at least one member; got {size}")
    if size == 1:
        return []
    gap = 2 ** ((size - 1).bit_length() - 1)
    schedule = [(gap, size - gap)]
    while gap > 1:
        gap //= 2
        schedule.append((gap, gap))
    return schedule


def bruck_rounds(size: int) -> list[tuple[int, int]]:
    """``(gap, count)`` per round of a Bruck all-gather among ``size`` members: member m sends the first ``count``
    items it holds (its own, then those of m+1, m+2, ...) to m-gap and appends ``count`` items from m+gap.
    ceil(log2 size) rounds, size - 1 items sent in all."""
    schedule, gap = [], 1
    while gap < size:
        schedule.append((gap, min(gap, size - gap)))
        gap *= 2
    return schedule


def bruck_allgather(parts: list[torch.Tensor], me: int, size: int, rank_of) -> Program:
    """All-gather among ``size`` members of one item per member (``parts``: this member's tensors, each with a
    leading dimension of 1); returns them stacked in member order (``out[j][m]`` is member m's ``parts[j][0]``).
    ``rank_of(m)`` is member m's rank in the group."""
    held = list(parts)
    for gap, count in bruck_rounds(size):
        sections = [(t.dtype, count * t[0].numel()) for t in held]
        src = rank_of((me + gap) % size)
        got = yield Round({rank_of((me - gap) % size): pack([t[:count] for t in held])},
                          {src: message_nbytes(sections)})
        pieces = unpack(got[src], sections)
        held = [torch.cat([t, piece.view(count, *t.shape[1:])]) for t, piece in zip(held, pieces)]
    return [torch.roll(t, me, 0) for t in held]  # item i came from member me + i


def take_top(blocks: torch.Tensor, rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest-magnitude entries (NaN and infinities first) of each block in ``rows``, zeroed in
    ``blocks``: ``(positions (len(rows), k), values)``."""
    picked = blocks[rows]
    index = torch.topk(picked.abs(), k, dim=1, sorted=False).indices
    values = picked.gather(1, index)
    blocks.view(-1).index_fill_(0, (rows[:, None] * blocks.shape[1] + index).reshape(-1), 0)
    return index, values


def add_into(blocks: torch.Tensor, rows: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """``blocks[rows[i], index[i]] += values[i]`` (positions distinct within a row, so the order is fixed)."""
    positions = rows[:, None] * blocks.shape[1] + index.long()
    blocks.view(-1).index_add_(0, positions.reshape(-1), values.reshape(-1))


def spar_reduce_scatter(blocks: torch.Tensor, me: int, k: int, rank_of, wire: SparseWire = SparseWire()) -> Program:
    """Spar-Reduce-Scatter among the ``blocks.shape[0]`` members: block ``me`` ends holding the team's sum; every
    other block is sent once and keeps what was not sent (with narrow values, what rounding took off the sent entries
    too). Messages as ``wire`` makes them."""
    size, width = blocks.shape
    for gap, count in reduce_scatter_rounds(size):
        ahead = torch.arange(count, device=blocks.device)
        send_rows, recv_rows = (me + gap + ahead) % size, (me + ahead) % size
        sections = wire.sections(width, k, blocks.dtype, count)
        tensors, index, exact, sent = wire.encode(*take_top(blocks, send_rows, k), width)
        if wire.values != "fp32":  # the rounding error stays in the block, as what was not sent
            add_into(blocks, send_rows, index, exact - sent)
        src = rank_of((me - gap) % size)
        got = yield Round({rank_of((me + gap) % size): pack(tensors)}, {src: message_nbytes(sections)})
        add_into(blocks, recv_rows, *wire.decode(unpack(got[src], sections), width, k, blocks.dtype, count))


def wire_allgather(index: torch.Tensor, values: torch.Tensor, width: int, me: int, size: int, rank_of,
                   wire: SparseWire) -> Program:
    """Bruck all-gather of one ``(1, k)`` set per member as ``wire`` makes it (each item its own code and scale,
    forwarded as it came): every member's ``(positions, values)``, ``(size, k)`` each, as decoded (this member's own
    too, so every rank holds the same bits)."""
    k = index.shape[1]
    tensors = wire.encode(index, values, width)[0]
    gathered = yield from bruck_allgather([t.reshape(1, -1) for t in tensors], me, size, rank_of)
    found, got = wire.decode(gathered, width, k, values.dtype)
    return found.view(size, k), got.view(size, k)


@dataclass
class Selection:
    """Every block's final choice, as every rank ends with it: ``index`` (Q, k) positions inside each block,
    ``values`` (Q, k) (zero where not ``valid``), ``valid`` (Q, k) bool or None when every entry counts, and ``union``
    (0-d) the size of the merged union before its cut to k (None with one team)."""

    index: torch.Tensor
    values: torch.Tensor
    valid: torch.Tensor | None
    union: torch.Tensor | None


def merge_teams(index: torch.Tensor, values: torch.Tensor, width: int, k: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The teams' choices for one block (``index``, ``values``: (d, h), in team order, so every member sums in the
    same order and gets the same bits) summed, and the top ``k`` of the union: ``(positions (k,), values, valid,
    union size)``; the union's members come first (``valid``), then padding sent with value 0."""
    summed = values.new_zeros(width)
    member = torch.zeros(width, dtype=torch.bool, device=values.device)
    for team in range(index.shape[0]):  # one pass per team: positions are distinct in each
        rows = index[team].long()
        summed.index_add_(0, rows, values[team])
        member.index_fill_(0, rows, True)
    score = torch.where(member, summed.abs(), -1.0)
    chosen = torch.topk(score, k, sorted=True).indices  # members (|v| >= 0, or NaN) before non-members (-1)
    valid = member[chosen]
    return chosen, torch.where(valid, summed[chosen], 0), valid, member.sum()


def spardl_program(blocks: torch.Tensor, rank: int, world: int, teams: int, k: int, h: int,
                   wire: SparseWire = SparseWire()) -> Program:
    """One rank's SparDL step on ``blocks`` (Q x B, Q = world / teams: the compensated bucket, turned in place into
    the provisional residual); ``k`` entries per block and message, ``h`` per team in Spar-All-Gather (``h == k`` with
    one team). Returns a ``Selection``. With one team every message as ``wire`` makes it; with several,
    Spar-All-Gather and the final all-gather send raw positions and the bucket's dtype, and each final block its
    length (an int32)."""
    size, width = blocks.shape
    if size * teams != world:
        raise ValueError(f"{world} workers in {teams} teams need {world // teams} blocks, got {size}")
    team, me = divmod(rank, size)

    def rank_of(m):
        return team * size + m

    yield from spar_reduce_scatter(blocks, me, k, rank_of, wire)
    own = torch.full((1,), me, device=blocks.device)  # torch.tensor would copy from the host: a sync on a GPU
    index, values = take_top(blocks, own, h)
    if teams == 1:
        if wire.values != "fp32":  # the own block keeps what rounding takes off, as what it did not pass on
            add_into(blocks, own, index, values - narrow(values, wire.values)[2])
        found, got = yield from wire_allgather(index, values, width, me, size, rank_of, wire)
        return Selection(found, got, None, None)
    itype = index_dtype(width)
    index, values = yield from bruck_allgather([index.to(itype), values], team, teams, lambda t: t * size + me)
    chosen, values, valid, union = merge_teams(index, values, width, k)
    # Values the cut dropped need no bookkeeping: they are off the final support, where the global residual
    # collection gives every rank back its own original entry.
    parts = [chosen.to(itype)[None], values[None], valid.sum(dtype=torch.int32)[None]]
    gathered = yield from bruck_allgather(parts, me, size, rank_of)
    valid = torch.arange(k, device=blocks.device)[None, :] < gathered[2][:, None]
    return Selection(gathered[0].long(), gathered[1], valid, union)
