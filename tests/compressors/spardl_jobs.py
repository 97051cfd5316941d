"""Rank jobs for tests/compressors/test_spardl.py and test_gtopk.py (module level, so worker processes can run them),
and ``simulate``: one step of a point-to-point method on simulated ranks."""
from __future__ import annotations

import torch
import torch.distributed as dist

import gcomp
from gcomp.collectives.program import run_locally
from gcomp.testing.buckets import FakeBucket
from tests.models import mlp


def simulate(compressors: list, states: list[dict], xs: list[torch.Tensor], info: gcomp.BucketInfo) -> tuple:
    """One step of ``compressors`` (one per simulated rank, each with its layout's ``states``, the ``residuals`` slot
    updated in place) on the gradients ``xs``: every rank's result and compensated input."""
    world = len(compressors)
    ctxs = [c.encode(x, state, info)[0].ctx for c, x, state in zip(compressors, xs, states)]
    results = run_locally([c.program(ctx, r, world) for r, (c, ctx) in enumerate(zip(compressors, ctxs))])
    return results, [ctx.compensated for ctx in ctxs]


def slots(world: int, n: int, dtype: torch.dtype = torch.float32) -> list[dict]:
    """Every simulated rank's ``residuals`` slot, zeros at first, as the method keeps them."""
    return [{"residuals": torch.zeros(n, dtype=dtype)} for _ in range(world)]


def bytes_job(name: str, params: dict, numel: int, steps: int = 2, seed: int = 0) -> dict:
    """Feed ``steps`` fake buckets of ``numel`` fp32 entries (one parameter) through the hook, compressing from
    the first step; returns this rank's stats, the results and every rank's results gathered."""
    rank = dist.get_rank()
    state = gcomp.HookState(gcomp.create(name, **params))  # no model: the fake bucket's parameter is its own
    state.warmup = 0
    param = torch.nn.Parameter(torch.zeros(numel))
    results = []
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        bucket = FakeBucket(torch.randn(numel, generator=g), 0, True, [param])
        results.append(state.reduce(bucket).wait().clone())
    mine = torch.stack(results)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return {"stats": dict(state.stats), "same": all(torch.equal(t, mine) for t in every)}


def install_job(name: str, params: dict) -> str | None:
    """The ValueError message of installing ``name`` with ``params`` on this group, or None."""
    try:
        gcomp.install(torch.nn.parallel.DistributedDataParallel(mlp(0)), name, **params)
    except ValueError as err:
        return str(err)
    return None
