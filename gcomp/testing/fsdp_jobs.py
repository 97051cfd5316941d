"""Contract 11: FSDP2's reduce-scatter of a method that serves it, called as FSDP calls it (``state.comms[0]``) on
fixed inputs, every check computed on every rank in one job per world size (``job_fsdp``), read by ``check_fsdp``."""
from __future__ import annotations

import collections
import copy

import torch
import torch.distributed as dist

import gcomp
from gcomp.testing import fidelity, models
from gcomp.testing.reduce_jobs import ALONE, alone_group, joined
from gcomp.testing.report import Skip
from gcomp.testing.source import MethodSource

CHECKS = ("fidelity", "conservation", "nonfinite", "avg")
STEPS = 3  # calls of one input: error feedback carries residuals on


def _call(comm, x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    out = torch.full((x.numel() // dist.get_world_size(),), float("nan"), dtype=x.dtype)
    comm(out, x.clone(), dist.group.WORLD, op)
    return out


def _gather(t: torch.Tensor) -> torch.Tensor:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return torch.stack(out)


def _held(method, layout, like: torch.Tensor) -> torch.Tensor:
    out = copy.deepcopy(method).flush(layout.pieces, like)
    return torch.zeros_like(like) if out is None else out.reshape(-1).to(like.dtype)


def _fidelity(source: MethodSource, method, layout, x, rows: torch.Tensor, first: torch.Tensor, dtypes):
    """This rank's shard from a fresh method (``first``) as the error model says: of the rows sent to this rank
    (``rows``, ``(world, shard)``); for one rank's input, each row on this rank alone (``"each"``), or the input
    whole (``"whole"``)."""
    kind, world = method.traits.fidelity, dist.get_world_size()
    if kind.kind in ("exact", "relative"):
        return fidelity.check_sum(kind, first.double(), rows.double(), dtypes, "this rank's shard")
    if kind.kind in ALONE:
        single, stats = joined(source, None, alone_group())
        if method.traits.rows == "native":
            return ("skip", "a native rows codec has no rows to reduce alone")
        parts = x.view(world, -1)
        if method.traits.rows == "whole":
            alone = single.reduce(x.clone(), layout.pieces, alone_group(), stats).wait().view(world, -1)
        else:
            alone = [copy.deepcopy(single).reduce(parts[r].clone(), layout.row(r), alone_group(), stats).wait()
                     for r in range(world)]
        for r in range(world):
            off = fidelity.check_alone(kind, parts[r].double(), alone[r].double().reshape(-1), f"row {r} alone")
            if off is not None:
                return off
    return None


def job_fsdp(sources: list[MethodSource]) -> dict:
    """Per method (by label): its first and last call's shard, the exact sum's, the checks' messages
    (``checks``: None, a message, or ``("skip", reason)``), each call's bytes, the stats, the pruned mask (methods
    that read the model get a pruned model) and the method's state."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for source in sources:
        method = source.create()
        model = models.fsdp_mlp(method.reads_model)
        state = source.install(model)
        comm, method = state.comms[0], state.method
        numel = world * sum(-(-s[0] // world) * (s[1] if len(s) > 1 else 1)
                            for s in (p.size() for p in model[0].parameters()))
        x = torch.randn(numel, generator=torch.Generator().manual_seed(rank)).mul_(torch.logspace(-2, 2, numel))
        layout = comm.layout_for(x, dist.group.WORLD)
        mask = None
        if method.reads_model:  # zero where pruned, every rank alike (weight_orig * weight_mask), and FSDP's padding
            mask = layout.shard_major([getattr(model[0], "weight_mask", None) if n.endswith("weight_orig") else None
                                       for n in layout.names], 1.0, 0.0, torch.float32, "cpu")
            x *= mask.reshape(-1)
        inputs = _gather(x)
        rows, total = inputs.view(world, world, -1)[:, rank], inputs.sum(0)
        kind = method.traits.fidelity if isinstance(method, gcomp.Method) else None
        dtypes = [x.dtype] + ([] if kind is None else [t.dtype for t in copy.deepcopy(method)._send(
            x.clone(), layout, collections.defaultdict(float)).tensors])
        calls, call_bytes = [], []
        for _ in range(STEPS):
            before = state.stats["bytes_sent"]
            calls.append(_call(comm, x))
            call_bytes.append(state.stats["bytes_sent"] - before)
        checks = {"nonfinite": None, "avg": ("skip", "AVG is checked for exact and relative error models")}
        if kind is None:
            checks["fidelity"] = ("skip", f"{type(method).__name__} declares no error model")
        elif kind.kind == "unbiased":
            draws = torch.stack([_call(comm, x).double() for _ in range(fidelity.DRAWS)])
            checks["fidelity"] = fidelity.check_draws(draws.sum(0), draws.square().sum(0), fidelity.DRAWS,
                                                      rows.double().sum(0), rows.double().abs().sum(0),
                                                      dtypes, "this rank's shard")
        else:
            checks["fidelity"] = _fidelity(source, method, layout, x, rows, calls[0], dtypes)
        checks["conservation"] = ("skip", "applies to methods with error feedback")
        if method.error_feedback:
            conserved = _gather(torch.stack(calls).sum(0)).reshape(-1) + _gather(_held(method, layout, x)).sum(0)
            checks["conservation"] = fidelity.mismatch(conserved, total.double() * STEPS,
                                                       1e-3 + 1e-4 * (total.double() * STEPS).abs(),
                                                       f"every call's shards and what every rank holds back after "
                                                       f"{STEPS} calls vs the sum of the inputs")
        bad = x.clone()
        if rank == 0:
            bad.view(world, -1)[world - 1][0] = float("nan")
        nan = bool(torch.isnan(_call(comm, bad)).any())
        checks["nonfinite"] = None if nan or rank != world - 1 else f"a NaN in rank 0's row for shard {rank} did not reach it"
        avg = _call(comm, x, dist.ReduceOp.AVG)
        if kind is not None and kind.kind in ("exact", "relative"):
            checks["avg"] = fidelity.check_sum(kind, avg.double(), rows.double() / world, dtypes,
                                               "AVG: the shard of the sum divided by the shard count")
        out[source.label] = {"first": calls[0], "last": calls[-1], "sum": total.view(world, -1)[rank],
                             "checks": checks, "call_bytes": call_bytes, "stats": dict(state.stats), "mask": mask,
                             "own_mask": None if mask is None else mask[rank], "sizes": [tuple(s) for s in layout.sizes],
                             "state": method.state_dict()}
    return out


def check_fsdp(ranks: list[dict], label: str, what: str) -> None:
    """One of ``CHECKS`` of ``job_fsdp``'s results for ``label``: AssertionError naming the rank, or Skip."""
    for rank, r in enumerate(ranks):
        found = r[label]["checks"][what]
        if isinstance(found, tuple):
            raise Skip(found[1])
        if found is not None:
            raise AssertionError(f"rank {rank}: {found}")
