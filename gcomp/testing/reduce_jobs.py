"""The rank job of contracts 1, 4 and 6: fake buckets fed to ``HookState.reduce`` on every rank.

Module-level, so ``gcomp.testing.ranks.run_ranks`` can send it to its worker processes. One call covers every
(path, layout, dtype) and every non-finite case for one method, so a method costs one round trip per world
size; ``gcomp.testing.process_checks`` reads the result.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import gcomp
from gcomp.testing import models
from gcomp.testing.buckets import DTYPES, LAYOUTS, FakeBucket, bucket_groups, dtype_name, fake_gradient
from gcomp.testing.source import MethodSource, as_source
from gcomp.testing.tolerance import mismatch, sum_bound, wire_precision

PATHS = ("warmup", "compress")
NONFINITE = {"nan": float("nan"), "inf": float("inf")}
REDUCE_STEPS = 3          # fake-bucket steps per configuration (enough for error feedback to carry a residual)


def _seed(*parts: int) -> int:
    value = 0
    for p in parts:
        value = value * 1009 + p
    return value


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``t``, in rank order."""
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _reduce_bucket(state: gcomp.HookState, bucket: FakeBucket, warming_up: bool) -> dict:
    """Feed one bucket to the hook; returns the pending result and this rank's part of the expectation.

    The expectation of the compressing path is each rank's payload decoded locally (its compressor run on a
    copy of the method, so nothing the hook keeps is touched): their sum over ranks is the mean of what the
    ranks sent, the buckets having been scaled by 1/N as the hook does. A method that is not a ``gcomp.Method``
    has no codec to run alone: its expectation is left out (``decoded`` None).
    """
    world = dist.get_world_size()
    raw = bucket.buffer().clone()
    decoded = None
    if warming_up:
        eps, tiny = wire_precision([], raw.dtype)
        decoded = raw.clone().mul_(1.0 / world)
    elif isinstance(state.method, gcomp.Method):
        twin = copy.deepcopy(state.method)
        info = state.bucket_info(bucket)
        compensated = twin.memory.compensate(raw.clone().mul_(1.0 / world), info)
        payload = twin.compressor.compress(compensated, info)
        decoded = twin.compressor.decompress(payload.tensors, payload.ctx)
        eps, tiny = wire_precision(payload.tensors, raw.dtype)
    else:
        eps, tiny = wire_precision([], raw.dtype)
    return {"fut": state.reduce(bucket), "raw": raw, "decoded": decoded, "eps": eps, "tiny": tiny}


def _check(pending: dict, where: str) -> dict:
    """Wait for one bucket and check it (collective: every rank calls it in the same order).

    Every rank reports its result's shape, dtype and device next to the bucket's; rank 0 also reports which
    ranks' results differ from its own and, as messages (None when fine), how far the result is from the
    mean of the locally decoded payloads (``mean``; the string ``"not checked"`` when there is no codec to
    decode them with) and from the exact mean of the raw buckets (``dense``).
    """
    result = pending["fut"].wait()
    raw, world = pending["raw"], dist.get_world_size()
    report = {"shape": tuple(result.shape), "dtype": result.dtype, "device": str(result.device),
              "bucket": (tuple(raw.shape), raw.dtype, str(raw.device))}
    results = _gather(result.to(raw.dtype).reshape(raw.shape))
    checked = pending["decoded"] is not None  # alike on every rank: the same method everywhere
    decoded = torch.stack([t.double() for t in _gather(pending["decoded"])]) if checked else None
    raws = torch.stack([t.double() for t in _gather(raw)])
    if dist.get_rank() == 0:
        eps, tiny = pending["eps"], pending["tiny"]
        report["differ"] = [r for r in range(world) if not torch.equal(results[r], results[0])]
        report["mean"] = "not checked" if not checked else mismatch(
            result, decoded.sum(0), sum_bound(world, decoded.abs().sum(0), eps, tiny),
            f"{where}: mean of the payloads")
        report["dense"] = mismatch(result, raws.sum(0) / world,
                                   sum_bound(world + 1, raws.abs().sum(0) / world, eps, tiny),
                                   f"{where}: dense mean")
    return report


def _state(source: MethodSource, ddp_model, path: str) -> gcomp.HookState:
    state = gcomp.HookState(source.create(), ddp_model, None)
    state.warmup = 10**9 if path == "warmup" else 0
    return state


def job_reduce(method: str | MethodSource, seed: int = 0) -> dict:
    """Contracts 1, 4 and 6 with fake buckets: every (path, layout, dtype), then every non-finite case.

    ``method``: a registered name or a ``MethodSource``. Returns ``{(path, layout, dtype_name): [[bucket report
    (see _check), ...] per step]}`` and ``{("nonfinite", path, kind): whether this rank's result for the bucket
    with the bad entry is all finite}``.
    """
    source = as_source(method)
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for dtype in DTYPES:
        ddp_model = models.ddp(models.mlp(seed).to(dtype))
        for path in PATHS:
            for layout in LAYOUTS:
                state = _state(source, ddp_model, path)
                groups = bucket_groups(ddp_model.module, layout)
                key = (path, layout, dtype_name(dtype))
                steps = []
                for step in range(REDUCE_STEPS):
                    pending = []  # like DDP: every bucket launched before any is waited for
                    for index, params in enumerate(groups):
                        grad = fake_gradient(params, dtype, seed=_seed(seed, step, rank, index))
                        bucket = FakeBucket(grad, index, index == len(groups) - 1, params)
                        pending.append(_reduce_bucket(state, bucket, path == "warmup"))
                    steps.append([_check(p, f"{key} step {step} bucket {i}") for i, p in enumerate(pending)])
                out[key] = steps
    # Contract 6: one rank (the last) holds a non-finite entry in bucket 0 of the second step.
    ddp_model = models.ddp(models.mlp(seed))
    groups = bucket_groups(ddp_model.module, "several")
    for path in PATHS:
        for kind, bad in NONFINITE.items():
            state = _state(source, ddp_model, path)
            for step in range(2):
                futures = []
                for index, params in enumerate(groups):
                    grad = fake_gradient(params, torch.float32, seed=_seed(seed + 7, step, rank, index))
                    if step == 1 and index == 0 and rank == world - 1:
                        grad[grad.numel() // 3] = bad
                    futures.append(state.reduce(FakeBucket(grad, index, index == len(groups) - 1, params)))
                results = [f.wait() for f in futures]
            out[("nonfinite", path, kind)] = bool(torch.isfinite(results[0]).all())
    return out
