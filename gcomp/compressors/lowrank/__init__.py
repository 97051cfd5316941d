"""The low-rank family: ``powersgd``, rank-r PowerSGD (Vogels, Karimireddy, Jaggi, NeurIPS 2019) with error
feedback and warm start."""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Annotated

import torch

from gcomp.collectives.reduce import ChainedAllreduceCommunicator, ChainedCompressor
from gcomp.core import Keeps, NoMemory, Payload, Traits, contraction
from gcomp.method import Method
from gcomp.params import Range
from gcomp.randomness import Stream, stream_seed
from gcomp.registry import register
from gcomp.state_checks import check_state, generator_state, tensor_dict

ORTHOGONALISATION_EPS = 1e-8


def orthogonalise(stack: torch.Tensor, eps: float = ORTHOGONALISATION_EPS) -> torch.Tensor:
    """Orthonormal columns spanning those of each (n, r) matrix of a (..., n, r) stack, written in place;
    deterministic, so every rank turns the same summed P into the same P^.

    Rank 1: a normalisation (``eps`` keeps a zero column at zero). Rank > 1: Householder QR, which stays
    orthonormal when P is rank-deficient (a gradient of lower rank than r); Gram-Schmidt would normalise rounding
    noise into columns that are not orthogonal, and P^ P^T M would no longer be a projection."""
    if stack.shape[-1] == 1:
        return stack.div_(torch.linalg.vector_norm(stack, dim=(-2, -1), keepdim=True) + eps)
    return stack.copy_(torch.linalg.qr(stack).Q)


@dataclass
class _Group:
    """The compressed matrices of one shape: their names and places among the bucket's parameters, where their P
    and Q blocks start in the round buffers, and their queries on the bucket's device."""

    n: int
    m: int
    r: int
    names: tuple[str, ...]
    parts: tuple[int, ...]
    p_start: int
    q_start: int
    first: torch.Tensor | None = None  # (B, m, r): the first queries
    queries: torch.Tensor | None = None  # (B, m, r): the last step's mean Q
    rows: tuple = ()  # its rows, as lent to the compressor's queries by name

    def p(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[self.p_start:self.p_start + len(self.names) * self.n * self.r].view(-1, self.n, self.r)

    def q(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[self.q_start:self.q_start + len(self.names) * self.m * self.r].view(-1, self.m, self.r)


@dataclass
class _Plan:
    """How one bucket layout is sent: its parameters' sizes, which travel dense, the groups, and for each parameter
    in bucket order where its decoded entries come from: ``(-1, i)`` dense part i, ``(g, row)`` a group's row."""

    sizes: tuple[int, ...]
    dense: tuple[int, ...]
    dense_sizes: tuple[int, ...]
    groups: tuple[_Group, ...]
    order: tuple[tuple[int, int], ...]
    q_numel: int


@dataclass
class _Ctx:
    plan: _Plan
    dtype: torch.dtype
    matrices: list = field(default_factory=list)  # per group, (B, n, m): M plus the error; then the new error
    errors: torch.Tensor | None = None  # the error slot second_round fills
    exchanged: bool = False  # the P sum orthogonalised in place, Q holds M^T P^


def _assemble(plan: _Plan, dense, rows, out: torch.Tensor | None = None) -> torch.Tensor:
    """The bucket put together in one ``cat`` from its dense parts and its groups' rows."""
    return torch.cat([dense[i] if g < 0 else rows[g][i] for g, i in plan.order], out=out)


class PowerSGDCompressor(ChainedCompressor):
    """Rank-r PowerSGD, by two chained SUM all-reduces. Per compressed parameter, an n x m matrix M (its dim 0 by
    the rest) plus its error: P = M Q (n x r, Q the warm-start query) goes in the first round after the dense
    entries (vectors, and matrices that would shrink by less than ``min_compression_rate``); every rank
    orthogonalises the summed P alike into P^ and sends Q = M^T P^ (m x r) in the second round; the result is
    P^ (sum Q)^T. (n + m) r numbers instead of n m, in fp32 (fp64 for an fp64 bucket). Matrices of one shape go
    as one stack: the P and Q blocks group by group in order of first appearance, in bucket order within a group.
    A bucket without compressed matrices takes the first round only; without a bound model every parameter is
    dense (exact).

    The error slot (``errors``, zero on dense entries) holds what the shared basis did not carry of this rank's
    M, M - P^ (M^T P^)^T: summed over ranks it is PyTorch's error, so resuming on another world size keeps the
    sums all later steps depend on. The warm-start queries (the mean Q of each matrix) are its own state, by
    parameter name, the same on every rank."""

    def __init__(self, rank: int = 1, min_compression_rate: float = 2.0, error_feedback: bool = True,
                 warm_start: bool = True, seed: int = 0):
        # ``rank`` is the approximation's matrix rank (PyTorch's name); a rank everywhere else is a process's
        self.approx_rank, self.min_compression_rate = rank, min_compression_rate
        self.error_feedback, self.warm_start, self.seed = error_feedback, warm_start, seed
        self.stream = Stream(seed, "powersgd")  # fresh queries without warm start, alike on every rank
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._plans: dict[str, _Plan] = {}
        self._queries: dict[str, torch.Tensor | None] = {}
        slots = ("errors",) if error_feedback else ()
        self.traits = Traits(fidelity=contraction(0.0), keeps=Keeps.LAYOUT, slots=slots, held=slots, rows=None,
                             decodes_alone=False)  # P^ is every rank's: not a sum of each rank's decode

    def bind(self, model, group, stats) -> None:
        if model is None:
            return
        self.shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
        self._plans.clear()
        if not any(self._compresses(shape) for shape in self.shapes.values()):
            warnings.warn(f"powersgd: with rank={self.approx_rank} and min_compression_rate="
                          f"{self.min_compression_rate} no parameter of this model is compressed (every matrix "
                          "would shrink too little): every bucket goes dense; lower the rank",
                          UserWarning, stacklevel=3)

    def _compresses(self, shape: tuple[int, ...]) -> bool:
        if len(shape) < 2 or not all(shape):
            return False
        n, m = shape[0], math.prod(shape[1:])
        return (n + m) * min(n, m, self.approx_rank) * self.min_compression_rate < n * m

    def _plan(self, layout) -> _Plan:
        plan = self._plans.get(layout.key)
        if plan is not None:
            return plan
        shapes: dict[tuple[int, int], list[int]] = {}
        dense = []
        for k, (name, _, numel) in enumerate(layout.segments()):
            shape = self.shapes.get(name)
            if shape is not None and math.prod(shape) == numel and self._compresses(shape):
                shapes.setdefault((shape[0], numel // shape[0]), []).append(k)
            else:
                dense.append(k)
        order = {k: (-1, i) for i, k in enumerate(dense)}
        groups, p_at, q_at = [], sum(layout.numels[k] for k in dense), 0
        for (n, m), parts in shapes.items():
            r = min(n, m, self.approx_rank)
            order.update({k: (len(groups), row) for row, k in enumerate(parts)})
            groups.append(_Group(n, m, r, tuple(layout.names[k] for k in parts), tuple(parts), p_at, q_at))
            p_at, q_at = p_at + len(parts) * n * r, q_at + len(parts) * m * r
        plan = self._plans[layout.key] = _Plan(layout.numels, tuple(dense), tuple(layout.numels[k] for k in dense),
                                               tuple(groups), tuple(order[k] for k in range(len(order))), q_at)
        return plan

    def _first(self, g: _Group, like: torch.Tensor) -> torch.Tensor:
        """Gaussian (m x r) per matrix, from a seed derived from ``seed`` and its name: the same on every rank,
        whatever bucket holds it."""
        if g.first is None or g.first.dtype != like.dtype or g.first.device != like.device:
            seeds = [stream_seed(self.seed, "powersgd", key=name) for name in g.names]
            g.first = torch.stack([torch.randn(g.m, g.r, generator=torch.Generator().manual_seed(s),
                                               dtype=torch.float64) for s in seeds]).to(like)
        return g.first

    def _query(self, g: _Group, like: torch.Tensor) -> torch.Tensor:
        """The orthonormal queries of this step, (B, m, r), a new tensor."""
        first = self._first(g, like)
        if not self.warm_start:
            return orthogonalise(torch.randn(first.shape, generator=self.stream.next(like.device),
                                             dtype=like.dtype, device=like.device))
        if not g.rows or not all(self._queries.get(name) is row for name, row in zip(g.names, g.rows)):
            # first sight, or a checkpoint loaded: the stack made again by name (the keys made here, by the
            # encode: the decode that fills them runs on the backend's threads)
            held = [self._queries.setdefault(name, None) for name in g.names]
            usable = [t is not None and tuple(t.shape) == (g.m, g.r) for t in held]
            g.queries = torch.stack([t.to(like) if ok else row for t, ok, row in zip(held, usable, first)]) \
                if any(usable) else None
            g.rows = ()
        if g.queries is None:
            return orthogonalise(first.clone())
        # a non-finite step, or a zero gradient, leaves a Q useless: that matrix starts again from its first query
        usable = torch.isfinite(g.queries).flatten(1).all(1) & (g.queries != 0).flatten(1).any(1)
        return orthogonalise(torch.where(usable[:, None, None], g.queries, first))

    def encode(self, x, state, layout):
        plan = self._plan(layout)
        wide = torch.float64 if x.dtype == torch.float64 else torch.float32
        v = x.reshape(-1).to(wide)
        if self.error_feedback:
            v = v + state["errors"]
        parts = v.split(plan.sizes)
        ctx = _Ctx(plan, layout.dtype)
        for g in plan.groups:  # copies: second_round writes the error into them
            ctx.matrices.append(torch.cat([parts[k] for k in g.parts]).view(-1, g.n, g.m))
        p = [torch.bmm(mat, self._query(g, v)).view(-1) for g, mat in zip(plan.groups, ctx.matrices)]
        round1 = torch.cat([parts[k] for k in plan.dense] + p)
        if not plan.groups:  # everything sent exactly: no error left
            return Payload([round1], ctx), {"errors": torch.zeros_like(v)} if self.error_feedback else state
        if self.error_feedback:
            ctx.errors = torch.empty_like(v)
            state = {"errors": ctx.errors}
        return Payload([round1, round1.new_zeros(plan.q_numel)], ctx), state

    def second_round(self, payload: Payload) -> None:
        """With ``tensors[0]`` holding the summed P: orthogonalise it in place, fill ``tensors[1]`` with this rank's
        Q = M^T P^, and fill the error slot with M - P^ Q^T."""
        round1, q_buffer = payload.tensors
        ctx: _Ctx = payload.ctx
        rows = []
        for g, mat in zip(ctx.plan.groups, ctx.matrices):
            p = orthogonalise(g.p(round1))
            q = torch.bmm(mat.transpose(1, 2), p, out=g.q(q_buffer))
            if ctx.errors is not None:  # M is not needed any more
                error = mat.sub_(torch.bmm(p, q.transpose(1, 2))).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
                rows.append(error.view(len(g.names), -1).unbind(0))
        if ctx.errors is not None:
            zeros = ctx.errors.new_zeros(sum(ctx.plan.dense_sizes)).split(ctx.plan.dense_sizes)
            _assemble(ctx.plan, zeros, rows, out=ctx.errors)
        ctx.matrices, ctx.exchanged = [], True

    def decode(self, received, ctx: _Ctx):
        """After both rounds: P^ (sum Q)^T, the mean Q kept as the next step's warm start. A rank's own payload
        (never exchanged) decodes alone to P_i^ P_i^T M_i."""
        plan, round1 = ctx.plan, received[0]
        dense = round1[:sum(plan.dense_sizes)].split(plan.dense_sizes)
        if self.warm_start and ctx.exchanged:
            kept = received[1].clone()
            for g in plan.groups:
                g.queries = g.q(kept)
                g.rows = g.queries.unbind(0)
                self._queries.update(zip(g.names, g.rows))
        rows = []
        for i, g in enumerate(plan.groups):
            p = g.p(round1)
            if ctx.exchanged:
                q = g.q(received[1])
            else:
                p = orthogonalise(p.clone())
                q = torch.bmm(ctx.matrices[i].transpose(1, 2), p)
            rows.append(torch.bmm(p, q.transpose(1, 2)).view(len(g.names), -1).unbind(0))
        return _assemble(plan, dense, rows).to(ctx.dtype)

    # --- checkpoint: {"generator": the stream, "queries": {name: (m, r)}} and the slot {"errors": {name: ...}} ----

    def state_dict(self) -> dict:
        return {"generator": self.stream.state_dict(),
                "queries": {name: q for name, q in self._queries.items() if q is not None}}

    def load_state_dict(self, state: dict) -> None:
        # "errors" here: a checkpoint of gcomp 0.1 made without error feedback, whose (empty) errors were its own
        check_state(self, state, {"generator": (torch.Tensor, dict), "queries": dict}, {"errors": dict})
        tensor_dict("powersgd", "queries", state["queries"])
        if isinstance(state["generator"], torch.Tensor):  # gcomp 0.1's generator: checked, the stream starts afresh
            generator_state("powersgd", "cpu", state["generator"])
        self._check_shapes(state["queries"])
        self.stream.load_state_dict(state["generator"])
        self._queries = {name: t.clone() for name, t in state["queries"].items()}

    def _check_shapes(self, queries: dict) -> None:
        """Each query of the shape (m x r) this model's parameter takes (once a model is bound): one of another
        shape would be dropped without a word at its first step."""
        for name, t in queries.items() if self.shapes else ():
            shape, where = self.shapes.get(name), f"powersgd: 'queries' of parameter {name!r}"
            if shape is None:
                raise ValueError(f"{where}: the model has no such parameter")
            if not self._compresses(shape):
                raise ValueError(f"{where}: the parameter (shape {tuple(shape)}) travels dense at rank="
                                 f"{self.approx_rank}, so it has none (a checkpoint of another rank or model?)")
            n, m = shape[0], math.prod(shape[1:])
            if tuple(t.shape) != (m, min(n, m, self.approx_rank)):
                raise ValueError(f"{where}: shape {tuple(t.shape)}, the parameter (shape {tuple(shape)}) at rank="
                                 f"{self.approx_rank} needs {(m, min(n, m, self.approx_rank))} (a checkpoint of "
                                 "another rank or model?)")

    def merge_states(self, assigned: list[dict], every: list[dict], rank: int) -> dict:
        """The queries and the stream are the same on every rank (the errors, a slot, are summed)."""
        return {"generator": every[0]["generator"], "queries": every[0]["queries"]}


@register("powersgd", paper="Vogels, Karimireddy, Jaggi 2019 (PowerSGD, NeurIPS)", variants=({"rank": 2},))
def powersgd(
    rank: Annotated[int, Range(1, None), "rank r of the approximation P Q^T of each matrix"] = 1,
    min_compression_rate: Annotated[float, Range(0, None, low_open=True),
                                   "compress a matrix only if n m > rate (n + m) r"] = 2.0,
    error_feedback: Annotated[bool, "add what the approximation missed to the next step's gradient"] = True,
    warm_start: Annotated[bool, "start each step from the previous step's Q (else a fresh random Q)"] = True,
    seed: Annotated[int, Range(0, None), "seed of the first (or, without warm start, every) query Q"] = 0,
) -> Method:
    """PowerSGD: low-rank P Q^T of each matrix by one power iteration, two chained all-reduces, vectors dense."""
    return Method(PowerSGDCompressor(rank, min_compression_rate, error_feedback, warm_start, seed), NoMemory(),
                  ChainedAllreduceCommunicator())
