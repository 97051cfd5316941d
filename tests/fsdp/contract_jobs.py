"""Rank jobs of the FSDP2 contract suite (tests/fsdp/test_contracts.py): every FSDP-capable method's reduce-scatter
called directly (``state.comms[i]``, FSDP's own call) on synthetic inputs, several checks per job."""
from __future__ import annotations

import torch
import torch.distributed as dist

import gcomp
from gcomp.fsdp import fsdp_configs
from tests.fsdp.fsdp_jobs import build

PARAMS = {"randomk": {"ratio": 0.2}, "spardl": {"density": 0.2}}
# every FSDP-capable method with the suite's parameters, then every variant its codec declares (pactrain's ternary)
CONFIGS = tuple((label, name, {**PARAMS.get(name, {}), **params}) for label, name, params in fsdp_configs())
UNBIASED_CALLS = 1500


def _inputs(numel: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=g).mul_(torch.logspace(-2, 2, numel)).to(dtype)


def _residual(method, layout) -> torch.Tensor:
    track = getattr(method.compressor, "tracker", None)
    track = track.tracks.get(layout.params.key) if track is not None else None
    if track is not None and track.support is not None and track.carry.residual is not None:
        # pactrain's ternary residual: the rank's kept entries, parameter by parameter, back at their positions
        positions = track.support.ternary.positions
        return torch.zeros(layout.numel).index_copy_(0, positions, track.carry.residual.float())
    memory = getattr(method.compressor, "memory", method.memory)
    held = memory.state_dict().get("residuals", {})
    parts = [held.get(name, torch.zeros(n)) for name, n in zip(layout.pieces.names, layout.pieces.numels)]
    return torch.cat([p.reshape(-1).float() for p in parts])


def _call(comm, x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    out = torch.full((x.numel() // dist.get_world_size(),), float("nan"), dtype=x.dtype)
    comm(out, x.clone(), dist.group.WORLD, op)
    return out


def _mask(model, comm, x) -> torch.Tensor | None:
    """The pruned module's support in the input's layout (1 kept, 0 pruned or FSDP's padding)."""
    comm.layout_for(x, dist.group.WORLD)
    return comm.layout.shard_major([getattr(model[0], "weight_mask", None) if n.endswith("weight_orig")
                                    else None for n in comm.layout.names], 1.0, 0.0, torch.float32, "cpu")


def job_contracts(configs=CONFIGS) -> dict:
    """Per configuration: the reduce-scatter's result against the exact sum (the module's shard), error feedback's
    conservation, a non-finite entry surfacing on the shard it belongs to, FSDP's AVG honoured; each call's bytes,
    pruned entries of the output, the carried ternary scale."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for label, name, params in configs:
        pruned = name == "pactrain"
        model = build(pruned)
        state = gcomp.install(model, name, **params)
        comm = state.comms[0]
        numel = world * sum(-(-s[0] // world) * (s[1] if len(s) > 1 else 1)
                            for s in (p.size() for p in model[0].parameters()))
        x = _inputs(numel, seed=rank)
        mask = _mask(model, comm, x) if pruned else None
        if pruned:  # a pruned gradient: zero where the mask is, every rank alike (weight_orig * weight_mask)
            x *= mask.reshape(-1)
        total = x.clone()
        dist.all_reduce(total)
        steps, call_bytes = [], []
        for step in range(3):  # pactrain packs from the first step; error feedback carries residuals on
            before = state.stats["bytes_sent"]
            steps.append(_call(comm, x))
            call_bytes.append(state.stats["bytes_sent"] - before)
        track = getattr(state.method.compressor, "tracker", None)
        track = track.tracks.get(comm.layout.params.key) if track is not None else None
        exponents = track.carry.exponents if track is not None else None
        layout = comm.layout
        mine = total.view(world, -1)[rank]
        shards = [torch.empty_like(steps[0]) for _ in range(world)]
        dist.all_gather(shards, torch.stack(steps).sum(0))  # what reached every shard over the steps
        residual = _residual(state.method, layout)
        residuals = [torch.empty_like(residual) for _ in range(world)]
        dist.all_gather(residuals, residual)
        bad = x.clone()
        if rank == 0:
            bad.view(world, -1)[world - 1][0] = float("nan")
        nan_out = _call(comm, bad)
        avg = _call(comm, x, dist.ReduceOp.AVG)
        out[label] = {"first": steps[0], "last": steps[-1], "sum": mine, "conserved": torch.cat(shards)
                      + torch.stack(residuals).sum(0)[:numel], "steps": len(steps), "total": total,
                      "lossless": state.method.lossless, "nan": bool(torch.isnan(nan_out).any()),
                      "nan_shard": world - 1, "avg": avg, "packed": state.stats.get("packed_buckets", 0),
                      "stats": dict(state.stats), "call_bytes": call_bytes,
                      "own_mask": None if mask is None else mask[rank],
                      "mask": mask, "sizes": [tuple(s) for s in layout.sizes],
                      "exponents": None if exponents is None else exponents.clone()}
    return out


def job_unbiased(configs, calls: int = UNBIASED_CALLS) -> dict:
    """Per configuration: the mean of ``calls`` reduce-scatters of one fixed input (each draws afresh) against its
    exact sum, and the bound a correct unbiased codec stays within (6 standard deviations: one rank's ternary
    entry has variance ``scale * |v| - v**2 <= scale**2 / 4``, the scale at most 9% above the shared max)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for label, name, params in configs:
        model = build(True)
        state = gcomp.install(model, name, **params)
        comm = state.comms[0]
        numel = world * sum(-(-s[0] // world) * (s[1] if len(s) > 1 else 1)
                            for s in (p.size() for p in model[0].parameters()))
        x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        mask = _mask(model, comm, x)
        x *= mask.reshape(-1)
        total = x.clone()
        dist.all_reduce(total)
        peak = x.abs().max()
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        acc = torch.zeros(numel // world, dtype=torch.float64)
        for _ in range(calls):
            acc += _call(comm, x)
        sigma = 1.09 * float(peak) * (world / 4 / calls) ** 0.5
        out[label] = {"mean": (acc / calls).float(), "sum": total.view(world, -1)[rank], "bound": 6 * sigma,
                      "own_mask": mask[rank], "stats": dict(state.stats)}
    return out


def job_refusals() -> dict:
    """The messages of every refusal at install, and of the registry's checks, under FSDP2."""
    out = {}
    cases = {"topk": ("topk", {}), "ternary": ("pactrain", {"ternary": True}), "teams": ("spardl", {"teams": 2}),
             "unknown": ("idenity", {}), "bad_param": ("randomk", {"ratio": 2.0}), "unknown_param": ("fp16", {"x": 1})}
    for key, (name, params) in cases.items():
        try:
            gcomp.install(build(False), name, **params)
            out[key] = None
        except (ValueError, RuntimeError) as err:
            out[key] = (type(err).__name__, str(err))
    for key, (name, params) in (("unknown", ("idenity", {})), ("bad_param", ("randomk", {"ratio": 2.0})),
                                ("unknown_param", ("fp16", {"x": 1}))):
        try:
            gcomp.create(name, **params)
        except ValueError as err:
            out[key + "_create"] = (type(err).__name__, str(err))
    model = build(False)
    gcomp.install(model, "identity")
    try:
        gcomp.install(model, "fp16")
        out["twice"] = None
    except RuntimeError as err:
        out["twice"] = str(err)
    return out
