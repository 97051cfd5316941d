"""PowerSGD's device path (``gcomp.kernels.on_device``): the bucket's compressed matrices stacked by shape, so that
every step runs a bounded number of operations per distinct shape (``torch.bmm`` and a batched orthogonalisation
on a (B, n, r) stack), never a loop over parameters.

On the wire, per bucket, what the CPU path sends (``gcomp.compressors.powersgd``): the dense entries, then P, in a
first SUM all-reduce, then Q in a second; only the order of the matrices' P and Q blocks differs: group after
group (in order of first appearance in the bucket), each group's matrices in bucket order. The bucket is cut by one
``split`` and each group's matrices copied into their stack by one ``cat``; the decoded bucket is put together by
one ``cat`` of the dense entries and the stacks' rows. The errors and warm-start queries stay keyed by parameter
name (checkpoints and the CPU path read the same dicts): their entries are the rows of the stacks (one ``unbind``),
and a stack is made again from the dicts only when an entry is not its row any more (a checkpoint loaded).

Differences from the CPU path: rounding only (batched products and norms), and without ``warm_start`` the fresh
queries of a group are one draw from the query generator (the CPU path draws matrix by matrix): other numbers,
the same on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gcomp.compressors.powersgd_plan import ORTHOGONALISATION_EPS, _Ctx, _Plan
from gcomp.core import Payload


def orthogonalise_batched(stack: torch.Tensor, eps: float = ORTHOGONALISATION_EPS) -> torch.Tensor:
    """``powersgd_plan.orthogonalise`` of every (n, r) matrix of a (B, n, r) stack at once, in place: rank 1 a
    normalisation, rank > 1 a batched Householder QR."""
    if stack.shape[-1] == 1:
        return stack.div_(torch.linalg.vector_norm(stack, dim=(1, 2), keepdim=True) + eps)
    return stack.copy_(torch.linalg.qr(stack).Q)


@dataclass(frozen=True)
class Group:
    """The compressed matrices of one shape: their indices in the plan, names, and where their P and Q blocks
    start in the device path's round buffers."""

    n: int
    m: int
    r: int
    members: tuple[int, ...]
    names: tuple[str, ...]
    p_start: int
    q_start: int

    def p(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[self.p_start:self.p_start + len(self.members) * self.n * self.r].view(-1, self.n, self.r)

    def q(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[self.q_start:self.q_start + len(self.members) * self.m * self.r].view(-1, self.m, self.r)


@dataclass
class GroupState:
    """A group's stacks across steps: its first queries, and the stacks whose rows are its names' entries."""

    first: torch.Tensor | None = None  # (B, m, r) in the compute dtype, on the bucket's device
    errors: torch.Tensor | None = None  # (B, n, m)
    error_rows: tuple = ()
    queries: torch.Tensor | None = None  # (B, m, r)
    query_rows: tuple = ()


@dataclass
class Stacks:
    """One bucket layout's plan on the device path, made once per layout (``stacks_of``)."""

    plan: _Plan
    tiles: bool  # the parameters cover the bucket end to end (else the CPU path runs)
    sizes: tuple[int, ...]  # of every parameter, in bucket order: one split
    dense_parts: tuple[int, ...]  # which of them travel dense
    groups: tuple[Group, ...]
    group_parts: tuple[tuple[int, ...], ...]
    order: tuple[tuple, ...]  # what fills each part when decoding: ("dense", i) or ("matrix", group, row)
    states: list[GroupState] = field(default_factory=list)


def stacks_of(plan: _Plan, numel: int) -> Stacks:
    """The device path's layout of ``plan`` (a bucket of ``numel`` entries)."""
    pieces = sorted([(offset, n, ("dense", i)) for i, (offset, n) in enumerate(plan.dense)]
                    + [(mat.offset, mat.n * mat.m, ("matrix", j)) for j, mat in enumerate(plan.matrices)])
    at, tiles = 0, True
    for offset, n, _ in pieces:
        tiles &= offset == at
        at = offset + n
    place = {role: k for k, (_, _, role) in enumerate(pieces)}
    shapes: dict[tuple, list[int]] = {}
    for j, mat in enumerate(plan.matrices):
        shapes.setdefault((mat.n, mat.m, mat.r), []).append(j)
    groups, row_of, p_at, q_at = [], {}, plan.dense_numel, 0
    for (n, m, r), members in shapes.items():
        for row, j in enumerate(members):
            row_of[j] = (len(groups), row)
        groups.append(Group(n, m, r, tuple(members), tuple(plan.matrices[j].name for j in members), p_at, q_at))
        p_at, q_at = p_at + len(members) * n * r, q_at + len(members) * m * r
    order = tuple(role if role[0] == "dense" else ("matrix", *row_of[role[1]]) for _, _, role in pieces)
    return Stacks(plan, tiles and at == numel, tuple(n for _, n, _ in pieces),
                  tuple(place[("dense", i)] for i in range(len(plan.dense))), tuple(groups),
                  tuple(tuple(place[("matrix", j)] for j in g.members) for g in groups), order,
                  [GroupState() for _ in groups])


def _rows_held(rows: tuple, names: tuple[str, ...], store: dict) -> bool:
    """Whether every name's entry in ``store`` is still this stack's row (a Python check: no operation)."""
    return bool(rows) and all(store.get(name) is row for name, row in zip(names, rows))


def _stack(store: dict, names: tuple[str, ...], shape: tuple[int, int], like: torch.Tensor,
           fill: torch.Tensor) -> torch.Tensor | None:
    """The entries of ``store`` for ``names`` stacked (``fill``'s row where one is missing or of another shape); None
    when none is held. A loop over parameters, taken only when a stack's rows are not the entries any more."""
    found = [store.get(name) for name in names]
    usable = [t is not None and tuple(t.shape) == shape for t in found]
    if not any(usable):
        return None
    return torch.stack([t.to(like) if ok else row for t, ok, row in zip(found, usable, fill)])


def _first(comp, stacks: Stacks, g: Group, state: GroupState, like: torch.Tensor) -> torch.Tensor:
    if state.first is None or state.first.dtype != like.dtype or state.first.device != like.device:
        state.first = torch.stack([comp._first_query(stacks.plan.matrices[j]).to(like) for j in g.members])
    return state.first


def _query(comp, stacks: Stacks, g: Group, state: GroupState, like: torch.Tensor) -> torch.Tensor:
    """The orthonormal queries of this step, (B, m, r), a new tensor (``PowerSGDCompressor._query`` batched)."""
    first = _first(comp, stacks, g, state, like)
    if not comp.warm_start:
        draws = torch.randn(first.numel(), generator=comp.generator, dtype=torch.float64)
        if like.device.type == "cuda":  # a copy from pageable memory would wait for the device
            draws = draws.pin_memory().to(like.device, non_blocking=True)
        return orthogonalise_batched(draws.to(like).view(first.shape))
    if _rows_held(state.query_rows, g.names, comp._queries):
        q = state.queries
    else:
        for name in g.names:  # the keys are made here, by the encode: the decode fills them on the backend's threads
            comp._queries.setdefault(name, None)
        q = _stack(comp._queries, g.names, (g.m, g.r), like, first)
        if q is None:
            return orthogonalise_batched(first.clone())
    # a non-finite step, or a zero gradient, leaves a Q useless: restart that matrix from its first query
    usable = torch.isfinite(q).flatten(1).all(1) & (q != 0).flatten(1).any(1)
    return orthogonalise_batched(torch.where(usable[:, None, None], q, first))


def compress(comp, stacks: Stacks, tensor: torch.Tensor, cdtype: torch.dtype) -> Payload:
    """``PowerSGDCompressor.compress`` on the stacks."""
    plan = stacks.plan
    round1 = torch.empty(plan.dense_numel + plan.p_numel, dtype=cdtype, device=tensor.device)
    parts = tensor.split(stacks.sizes)
    if stacks.dense_parts:
        dense = [parts[k] for k in stacks.dense_parts]
        if tensor.dtype == cdtype:
            torch.cat(dense, out=round1[:plan.dense_numel])
        else:
            round1[:plan.dense_numel].copy_(torch.cat(dense))
    ctx = _Ctx(plan, tensor.numel(), tensor.dtype, batched=stacks)
    if not plan.matrices:
        return Payload([round1], ctx)
    like = round1[:0]
    for g, ks, state in zip(stacks.groups, stacks.group_parts, stacks.states):
        matrix = torch.cat([parts[k] for k in ks]).view(-1, g.n, g.m)  # a copy: second_round may write it
        if matrix.dtype != cdtype:
            matrix = matrix.to(cdtype)
        if comp.error_feedback:
            if not _rows_held(state.error_rows, g.names, comp._errors):
                state.errors = _stack(comp._errors, g.names, (g.n, g.m), like,
                                      torch.zeros(len(g.members), g.n, g.m, dtype=cdtype, device=tensor.device))
                state.error_rows = ()
            if state.errors is not None:
                matrix += state.errors
        torch.bmm(matrix, _query(comp, stacks, g, state, like), out=g.p(round1))
        ctx.compensated.append(matrix)
    return Payload([round1, torch.zeros(plan.q_numel, dtype=cdtype, device=tensor.device)], ctx)


def second_round(comp, payload: Payload) -> None:
    """``PowerSGDCompressor.second_round`` on the stacks: orthogonalise each group's summed P in place, fill its Q
    with M^T P^ and keep the error M - P^ Q^T (in M's stack, whose rows become the errors' entries)."""
    round1, q_buffer = payload.tensors
    ctx: _Ctx = payload.ctx
    for g, state, matrix in zip(ctx.batched.groups, ctx.batched.states, ctx.compensated):
        p = orthogonalise_batched(g.p(round1))
        q = torch.bmm(matrix.transpose(1, 2), p, out=g.q(q_buffer))
        if comp.error_feedback:
            error = torch.sub(matrix, torch.bmm(p, q.transpose(1, 2)), out=matrix)  # M is not needed any more
            state.errors = error.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
            state.error_rows = error.unbind(0)
            comp._errors.update(zip(g.names, state.error_rows))
    ctx.compensated = []
    ctx.exchanged = True


def decompress(comp, tensors, ctx: _Ctx) -> torch.Tensor:
    """``PowerSGDCompressor.decompress`` on the stacks: the summed payload after both rounds (its mean Q kept as the
    next step's warm start), or this rank's own payload decoded alone."""
    stacks, plan = ctx.batched, ctx.plan
    round1 = tensors[0]
    if comp.warm_start and ctx.exchanged and plan.matrices:
        kept = tensors[1].clone()
        for g, state in zip(stacks.groups, stacks.states):
            state.queries = g.q(kept)
            state.query_rows = state.queries.unbind(0)
            comp._queries.update(zip(g.names, state.query_rows))
    dense = round1[:plan.dense_numel].split([n for _, n in plan.dense]) if plan.dense else ()
    rows = []
    for gi, g in enumerate(stacks.groups):
        p = g.p(round1)
        if ctx.exchanged:
            q = g.q(tensors[1])
        else:
            p = orthogonalise_batched(p.clone())
            q = torch.bmm(ctx.compensated[gi].transpose(1, 2), p)
        rows.append(torch.bmm(p, q.transpose(1, 2)).view(len(g.members), -1).unbind(0))
    out = torch.cat([dense[part[1]] if part[0] == "dense" else rows[part[1]][part[2]] for part in stacks.order])
    return out if out.dtype == ctx.dtype else out.to(ctx.dtype)
