"""``powersgd``: rank-r PowerSGD (Vogels, Karimireddy, Jaggi, NeurIPS 2019) with error feedback and warm start.

Per matrix-shaped gradient M (a parameter of shape (n, ...) seen as n x m), with Q the warm-start query:
P = M Q -> SUM all-reduce (waited) -> P^ = orthogonalise(P) -> Q = M^T P^ -> SUM all-reduce -> P^ Q^T: two
chained rounds (``gcomp.collectives.chained``).
The hook has already divided the bucket by the world size, so the Q sum is the mean and P^ Q^T approximates the
mean gradient. Vectors, and matrices that would not shrink by ``min_compression_rate``, travel dense inside the
P all-reduce. Parameter shapes come from the model the hook binds; a codec used without a model (a bare bucket)
sends every segment dense, which makes it an exact, homomorphic codec there.

Each round is a sum on the wire, but the result P^ (sum_i M_i^T P^)^T is not a sum of per-rank decodings: P^
comes from every rank's P. A rank's payload decoded alone (``decompress`` before the exchange) is its own
P_i^ P_i^T M_i, which is all a pure local codec can say about it.
"""
from __future__ import annotations

from typing import Annotated

import math
import warnings

import torch

from gcomp.collectives.chained import ChainedAllreduceCommunicator, ChainedCompressor
from gcomp.compressors import powersgd_batched as batched
# orthogonalise is imported from here too (its home until the device path)
from gcomp.compressors.powersgd_plan import _Ctx, _Matrix, _Plan, orthogonalise  # noqa: F401
from gcomp.compressors.quantise import stream_seed
from gcomp.core import ALLREDUCE, Payload, check_state, sum_by_name, tensor_dict
from gcomp.state_checks import generator_state
from gcomp.kernels import on_device
from gcomp.memory import NoMemory
from gcomp.method import Method
from gcomp.params import Range
from gcomp.registry import register

class PowerSGDCompressor(ChainedCompressor):
    """Rank-r PowerSGD: per compressed n x m matrix, P (n x r) in a first SUM all-reduce together with the dense
    entries (vectors, small matrices), waited for, then Q (m x r) in a second SUM all-reduce; (n + m) r numbers
    instead of n m, in fp32 (fp64 for an fp64 bucket). A bucket without compressed matrices takes the first
    round only.

    Memory: per compressed parameter an error buffer (n x m) and the warm-start Q (m x r), both keyed by the
    parameter's name, so they survive DDP's bucket rebuild and a checkpoint. The error is the part of this
    rank's M the shared basis P^ did not carry, M - P^ (M^T P^)^T; summed over ranks it equals PyTorch's
    (M - mean approximation), and the next step's sums (all PowerSGD's output depends on) are the same.
    """

    collective = ALLREDUCE
    decodes_alone = False  # the result is P·(Σ Mᵀ P)ᵀ with P shared: not a sum of per-rank decodes
    stateful = True

    def __init__(self, rank: int = 1, min_compression_rate: float = 2.0, error_feedback: bool = True,
                 warm_start: bool = True, seed: int = 0):
        # ``rank`` is the matrix rank of the approximation (the public name, as in PyTorch's hook); kept as
        # ``approx_rank``, since a rank everywhere else in gcomp is a process's
        self.approx_rank, self.min_compression_rate = rank, min_compression_rate
        self.error_feedback, self.warm_start, self.seed = error_feedback, warm_start, seed
        self.holds_gradient = error_feedback
        # fresh queries when warm_start is off, the same on every rank
        self.generator = torch.Generator().manual_seed(stream_seed(seed, "powersgd"))
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._plans: dict[str, _Plan] = {}
        self._queries: dict[str, torch.Tensor] = {}  # warm start: last step's mean Q per parameter
        self._errors: dict[str, torch.Tensor] = {}
        self._initial: dict[str, torch.Tensor] = {}  # first Q per parameter (derived from seed and name)
        self._stacks: dict[str, batched.Stacks] = {}  # the device path's layouts (``powersgd_batched``)

    def bind(self, model, group, stats) -> None:
        if model is not None:
            self.shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
            self._plans.clear()
            self._stacks.clear()
            if not any(self._compresses(shape) for shape in self.shapes.values()):
                warnings.warn(f"powersgd: with rank={self.approx_rank} and min_compression_rate="
                              f"{self.min_compression_rate} no parameter of this model is compressed (every matrix "
                              "would shrink too little): every bucket goes dense; lower the rank",
                              UserWarning, stacklevel=3)

    def _compresses(self, shape: tuple[int, ...]) -> bool:
        """Whether a parameter of ``shape`` travels as P and Q (else dense)."""
        if len(shape) < 2 or not all(shape):
            return False
        n, m = shape[0], math.prod(shape[1:])
        return (n + m) * min(n, m, self.approx_rank) * self.min_compression_rate < n * m

    # --- layout ---------------------------------------------------------------------------------------------

    def _plan(self, bucket) -> _Plan:
        plan = self._plans.get(bucket.key)
        if plan is None:
            plan = self._plans[bucket.key] = self._make_plan(bucket)
        return plan

    def _make_plan(self, bucket) -> _Plan:
        dense, matrices, dense_numel, p_numel, q_numel = [], [], 0, 0, 0
        for name, offset, numel in bucket.segments():
            shape = self.shapes.get(name)
            if shape is not None and math.prod(shape) == numel and self._compresses(shape):
                n, m = shape[0], numel // shape[0]
                matrices.append((name, offset, n, m, min(n, m, self.approx_rank)))
                continue
            dense.append((offset, numel))
            dense_numel += numel
        placed = []
        for name, offset, n, m, r in matrices:
            placed.append(_Matrix(name, offset, n, m, r, dense_numel + p_numel, q_numel))
            p_numel += n * r
            q_numel += m * r
        return _Plan(tuple(dense), dense_numel, tuple(placed), p_numel, q_numel)

    # --- encode ---------------------------------------------------------------------------------------------

    @staticmethod
    def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
        return torch.float64 if dtype == torch.float64 else torch.float32

    def _first_query(self, mat: _Matrix) -> torch.Tensor:
        """Gaussian (m x r) from a seed derived from ``seed`` and the parameter's name: the same on every rank,
        whatever bucket the parameter lies in or the order buckets are first seen."""
        q = self._initial.get(mat.name)
        if q is None or q.shape != (mat.m, mat.r):
            g = torch.Generator().manual_seed(stream_seed(self.seed, "powersgd", key=mat.name))
            q = self._initial[mat.name] = torch.randn(mat.m, mat.r, generator=g, dtype=torch.float64)
        return q

    def _query(self, mat: _Matrix, like: torch.Tensor) -> torch.Tensor:
        """The orthonormal query Q of this step (a new tensor)."""
        if not self.warm_start:
            q = torch.randn(mat.m, mat.r, generator=self.generator, dtype=torch.float64)
            return orthogonalise(q.to(like))
        first = self._first_query(mat).to(like)
        # the key is made here, by the encode: the decode that fills it runs on the backend's threads
        q = self._queries.setdefault(mat.name, None)
        if q is None or q.shape != first.shape:
            return orthogonalise(first)
        q = q.to(like)
        # A non-finite step, or a zero gradient, leaves Q useless (P = M Q would stay NaN or zero for good):
        # restart from the first query then. A tensor condition, so no host synchronisation.
        usable = torch.isfinite(q).all() & (q != 0).any()
        return orthogonalise(torch.where(usable, q, first))

    def compress(self, tensor, bucket):
        plan = self._plan(bucket)
        cdtype = self._compute_dtype(tensor.dtype)
        if on_device(tensor):  # matrices stacked by shape: no loop over parameters (``powersgd_batched``)
            stacks = self._stacks.get(bucket.key)
            if stacks is None:
                stacks = self._stacks[bucket.key] = batched.stacks_of(plan, tensor.numel())
            if stacks.tiles:
                return batched.compress(self, stacks, tensor, cdtype)
        round1 = torch.empty(plan.dense_numel + plan.p_numel, dtype=cdtype, device=tensor.device)
        start = 0
        for offset, numel in plan.dense:  # a loop over parameters, not entries
            round1[start:start + numel].copy_(tensor[offset:offset + numel])
            start += numel
        ctx = _Ctx(plan, tensor.numel(), tensor.dtype)
        if not plan.matrices:
            return Payload([round1], ctx)
        like = round1[:0]
        for mat in plan.matrices:
            matrix = tensor[mat.offset:mat.offset + mat.n * mat.m].view(mat.n, mat.m)
            error = self._errors.get(mat.name) if self.error_feedback else None
            if error is not None and error.shape == matrix.shape:
                matrix = matrix.to(cdtype) + error
            else:  # second_round overwrites M with the error: never the bucket itself
                matrix = matrix.to(cdtype, copy=self.error_feedback)
            p = round1[mat.p_offset:mat.p_offset + mat.n * mat.r].view(mat.n, mat.r)
            torch.matmul(matrix, self._query(mat, like), out=p)
            ctx.compensated.append(matrix)
        q_buffer = torch.zeros(plan.q_numel, dtype=cdtype, device=tensor.device)
        return Payload([round1, q_buffer], ctx)

    def flush(self, bucket, like):
        """The errors of ``bucket``'s compressed matrices, laid out in the bucket (zeros elsewhere), forgotten."""
        held = [(mat, self._errors.pop(mat.name)) for mat in self._plan(bucket).matrices if mat.name in self._errors]
        if not held:
            return None
        out = torch.zeros(like.numel(), dtype=like.dtype, device=like.device)
        for mat, error in held:  # a loop over parameters, not entries
            out[mat.offset:mat.offset + mat.n * mat.m].copy_(error.reshape(-1))
        return out

    def second_round(self, payload: Payload) -> None:
        """With ``tensors[0]`` holding the summed P: orthogonalise it in place, fill ``tensors[1]`` with this rank's
        Q = M^T P^ and keep the error M - P^ Q^T."""
        if payload.ctx.batched is not None:
            return batched.second_round(self, payload)
        round1, q_buffer = payload.tensors
        ctx: _Ctx = payload.ctx
        for mat, matrix in zip(ctx.plan.matrices, ctx.compensated):
            p = orthogonalise(round1[mat.p_offset:mat.p_offset + mat.n * mat.r].view(mat.n, mat.r))
            q = q_buffer[mat.q_offset:mat.q_offset + mat.m * mat.r].view(mat.m, mat.r)
            torch.matmul(matrix.t(), p, out=q)
            if self.error_feedback:
                error = torch.sub(matrix, p @ q.t(), out=matrix)  # M is not needed any more
                self._errors[mat.name] = error.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        ctx.compensated = []
        ctx.exchanged = True

    # --- decode ---------------------------------------------------------------------------------------------

    def decompress(self, tensors, ctx: _Ctx):
        """The summed payload after both rounds, whose mean Q is kept as the next step's warm start; or (never
        exchanged) this rank's own payload decoded alone: P^ = orthogonalise(P), Q = M^T P^, P^ Q^T."""
        if ctx.batched is not None:
            return batched.decompress(self, tensors, ctx)
        plan = ctx.plan
        if self.warm_start and ctx.exchanged:
            for mat in plan.matrices:
                self._queries[mat.name] = tensors[1][mat.q_offset:mat.q_offset + mat.m * mat.r].view(
                    mat.m, mat.r).clone()
        round1 = tensors[0]
        out = torch.empty(ctx.numel, dtype=round1.dtype, device=round1.device)
        start = 0
        for offset, numel in plan.dense:
            out[offset:offset + numel].copy_(round1[start:start + numel])
            start += numel
        for i, mat in enumerate(plan.matrices):
            p = round1[mat.p_offset:mat.p_offset + mat.n * mat.r].view(mat.n, mat.r)
            if ctx.exchanged:
                q = tensors[1][mat.q_offset:mat.q_offset + mat.m * mat.r].view(mat.m, mat.r)
            else:
                p = orthogonalise(p.clone())
                q = ctx.compensated[i].t() @ p
            torch.matmul(p, q.t(), out=out[mat.offset:mat.offset + mat.n * mat.m].view(mat.n, mat.m))
        return out if out.dtype == ctx.dtype else out.to(ctx.dtype)

    # --- checkpoint -------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state(),
                "queries": {n: q for n, q in self._queries.items() if q is not None},
                "errors": dict(self._errors)}

    def load_state_dict(self, state: dict) -> None:
        check_state(self, state, {"generator": torch.Tensor, "queries": dict, "errors": dict})
        tensor_dict("powersgd", "queries", state["queries"])
        tensor_dict("powersgd", "errors", state["errors"])
        generator_state("powersgd", "cpu", state["generator"])
        self._check_shapes(state["queries"], state["errors"])
        self.generator.set_state(state["generator"])
        self._queries = {n: t.clone() for n, t in state["queries"].items()}
        self._errors = {n: t.clone() for n, t in state["errors"].items()}

    def parameter_state(self, state: dict) -> dict:
        return {"errors": state["errors"]}

    def _check_shapes(self, queries: dict, errors: dict) -> None:
        """Each query (m x r) and error (n x m) of the shape this model's parameter takes at this rank (once a
        model is bound): one of another shape would be dropped without a word at its first step."""
        if not self.shapes:
            return  # no model: every bucket goes dense, nothing reads them
        for slot, held in (("queries", queries), ("errors", errors)):
            for name, t in held.items():
                shape = self.shapes.get(name)
                where = f"powersgd: {slot!r} of parameter {name!r}"
                if shape is None:
                    raise ValueError(f"{where}: the model has no such parameter")
                if not self._compresses(shape):
                    raise ValueError(f"{where}: the parameter (shape {tuple(shape)}) travels dense at rank="
                                     f"{self.approx_rank}, so it has none (a checkpoint of another rank or model?)")
                n, m = shape[0], math.prod(shape[1:])
                want = (m, min(n, m, self.approx_rank)) if slot == "queries" else (n, m)
                if tuple(t.shape) != want:
                    raise ValueError(f"{where}: shape {tuple(t.shape)}, the parameter (shape {tuple(shape)}) at "
                                     f"rank={self.approx_rank} needs {want} (a checkpoint of another rank or model?)")

    def merge_states(self, assigned: list[dict], every: list[dict], rank: int) -> dict:
        """Only the sum of the errors over ranks matters to the next steps: it is kept. The warm-start
        queries and the query generator are the same on every rank."""
        return {"generator": every[0]["generator"], "queries": every[0]["queries"],
                "errors": sum_by_name([s["errors"] for s in assigned])}


@register("powersgd", paper="Vogels, Karimireddy, Jaggi 2019 (PowerSGD, NeurIPS)")
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
