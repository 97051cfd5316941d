"""Rank jobs and helpers for the contract suite (tests/test_contracts.py).

The jobs are module-level so ``tests.distributed.run_ranks`` can send them to its worker processes. Each job
runs *several* configurations in one call, so the rank pools are reused and a method costs a handful of
round trips per world size instead of one per configuration.
"""
from __future__ import annotations

import copy
import io

import torch
import torch.distributed as dist

import gcomp
from tests import models

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
LAYOUTS = ("one", "several")
PATHS = ("warmup", "compress")
NONFINITE = {"nan": float("nan"), "inf": float("inf")}
REDUCE_STEPS = 3          # fake-bucket steps per configuration (enough for error feedback to carry a residual)
TRAIN_STEPS = 4           # DDP steps: past the static_graph warm-up (2 steps) with 2 compressing steps to spare
RESUME_AT, RESUME_STEPS = 2, 3   # one checkpoint after 2 steps, then 3 more


# --- tolerances ------------------------------------------------------------------------------------------------

def wire_precision(tensors, bucket_dtype: torch.dtype) -> tuple[float, float]:
    """``(eps, tiny)`` of the coarsest floating dtype among the payload tensors and the bucket.

    ``eps`` is the relative rounding of one operation in that dtype; ``tiny`` the spacing of its subnormals
    (the absolute rounding near zero).
    """
    dtypes = {t.dtype for t in tensors if t.is_floating_point()} | {bucket_dtype}
    infos = [torch.finfo(d) for d in dtypes]
    return max(i.eps for i in infos), max(i.smallest_normal * i.eps for i in infos)


def sum_bound(terms: int, magnitude: torch.Tensor, eps: float, tiny: float) -> torch.Tensor:
    """Elementwise bound on the rounding of a ``terms``-term sum (in any order) plus a cast of the result.

    ``magnitude`` is the sum of the absolute values of the terms (float64).
    """
    return (terms + 1) * (eps * magnitude + tiny)


# --- a fake DDP bucket -----------------------------------------------------------------------------------------

class FakeBucket:
    """What ``HookState.reduce`` reads of a ``dist.GradBucket``."""

    def __init__(self, buffer: torch.Tensor, index: int, last: bool, params: list[torch.nn.Parameter]):
        self._buffer, self._index, self._last, self._params = buffer, index, last, params

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last

    def parameters(self) -> list[torch.nn.Parameter]:
        return self._params


def bucket_groups(model: torch.nn.Module, layout: str) -> list[list[torch.nn.Parameter]]:
    """Parameters per bucket in DDP's rebuilt (backward) order: all in one bucket, or split in two."""
    params = list(model.parameters())[::-1]
    if layout == "one":
        return [params]
    half = len(params) // 2
    return [params[:half], params[half:]]


def fake_gradient(params, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A flat gradient whose parameters have magnitudes from 1e-3 to 1e3 (fp16-safe after summing 8 ranks)."""
    g = torch.Generator().manual_seed(seed)
    pieces = []
    for p in params:
        scale = 10.0 ** (6 * torch.rand((), generator=g, dtype=torch.float64) - 3)
        pieces.append(torch.randn(p.numel(), generator=g, dtype=torch.float64) * scale)
    return torch.cat(pieces).to(dtype)


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


def mismatch(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor, what: str) -> str | None:
    """None when ``|actual - expected| <= bound`` everywhere (float64), else a message about the first miss."""
    err = (actual.double() - expected).abs()
    bad = ~(err <= bound)
    if not bad.any():
        return None
    i = int(bad.nonzero()[0])
    return (f"{what}: {int(bad.sum())} of {bad.numel()} entries off; first at {i}: got {actual[i].item()!r}, "
            f"expected {expected[i].item()!r} within {bound[i].item():.3g}")


def _reduce_bucket(state: gcomp.HookState, bucket: FakeBucket, warming_up: bool) -> dict:
    """Feed one bucket to the hook; returns the pending result and this rank's part of the expectation.

    The expectation of the compressing path is each rank's payload decoded locally (its compressor run on a
    copy of the method, so nothing the hook keeps is touched): their sum over ranks is the mean of what the
    ranks sent, the buckets having been scaled by 1/N as the hook does.
    """
    world = dist.get_world_size()
    raw = bucket.buffer().clone()
    if warming_up:
        eps, tiny = wire_precision([], raw.dtype)
        decoded = raw.clone().mul_(1.0 / world)
    else:
        twin = copy.deepcopy(state.method)
        info = state.bucket_info(bucket)
        compensated = twin.memory.compensate(raw.clone().mul_(1.0 / world), info)
        payload = twin.compressor.compress(compensated, info)
        decoded = twin.compressor.decompress(payload.tensors, payload.ctx)
        eps, tiny = wire_precision(payload.tensors, raw.dtype)
    return {"fut": state.reduce(bucket), "raw": raw, "decoded": decoded, "eps": eps, "tiny": tiny}


def _check(pending: dict, where: str) -> dict:
    """Wait for one bucket and check it (collective: every rank calls it in the same order).

    Every rank reports its result's shape, dtype and device next to the bucket's; rank 0 also reports which
    ranks' results differ from its own and, as messages (None when fine), how far the result is from the
    mean of the locally decoded payloads (``mean``) and from the exact mean of the raw buckets (``dense``).
    """
    result = pending["fut"].wait()
    raw, world = pending["raw"], dist.get_world_size()
    report = {"shape": tuple(result.shape), "dtype": result.dtype, "device": str(result.device),
              "bucket": (tuple(raw.shape), raw.dtype, str(raw.device))}
    results = _gather(result.to(raw.dtype).reshape(raw.shape))
    decoded = torch.stack([t.double() for t in _gather(pending["decoded"])])
    raws = torch.stack([t.double() for t in _gather(raw)])
    if dist.get_rank() == 0:
        eps, tiny = pending["eps"], pending["tiny"]
        report["differ"] = [r for r in range(world) if not torch.equal(results[r], results[0])]
        report["mean"] = mismatch(result, decoded.sum(0), sum_bound(world, decoded.abs().sum(0), eps, tiny),
                                  f"{where}: mean of the payloads")
        report["dense"] = mismatch(result, raws.sum(0) / world,
                                   sum_bound(world + 1, raws.abs().sum(0) / world, eps, tiny),
                                   f"{where}: dense mean")
    return report


def _state(name: str, ddp_model, path: str) -> gcomp.HookState:
    state = gcomp.HookState(gcomp.create(name), ddp_model, None)
    state.warmup = 10**9 if path == "warmup" else 0
    return state


def job_reduce(name: str, seed: int = 0) -> dict:
    """Contracts 1, 4 and 6 with fake buckets: every (path, layout, dtype), then every non-finite case.

    Returns ``{(path, layout, dtype_name): [[bucket report (see _check), ...] per step]}`` and
    ``{("nonfinite", path, kind): whether this rank's result for the bucket with the bad entry is all finite}``.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for dtype in DTYPES:
        ddp_model = models.ddp(models.mlp(seed).to(dtype))
        for path in PATHS:
            for layout in LAYOUTS:
                state = _state(name, ddp_model, path)
                groups = bucket_groups(ddp_model.module, layout)
                key = (path, layout, str(dtype).removeprefix("torch."))
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
            state = _state(name, ddp_model, path)
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


# --- DDP training ----------------------------------------------------------------------------------------------

def _train_one(name: str | None, several: bool, static: bool, steps: int, seed: int) -> dict:
    model = models.mlp(seed)
    init = models.flat_params(model).clone()
    kwargs = {"static_graph": static}
    if several:
        kwargs["bucket_cap_mb"] = models.SEVERAL_BUCKETS_MB
    ddp_model = models.ddp(model, **kwargs)
    state = gcomp.install(ddp_model, name) if name is not None else None
    losses = torch.stack(models.train(ddp_model, steps))
    return {"params": models.flat_params(ddp_model.module).clone(), "init": init, "losses": losses,
            "stats": dict(state.stats) if state is not None else None}


def job_train(name: str, configs: list[tuple[bool, bool]], reference: bool, steps: int = TRAIN_STEPS,
              seed: int = 0) -> dict:
    """Contracts 2 and 4 in DDP: train each ``(several_buckets, static_graph)`` configuration.

    With ``reference`` a plain DDP run (no hook) of the same configuration is returned too.
    """
    out = {}
    for several, static in configs:
        out[(several, static)] = _train_one(name, several, static, steps, seed)
        if reference:
            out[(several, static)]["reference"] = _train_one(None, several, static, steps, seed)["params"]
    return out


# name -> (DDP options, steps between checkpoints). "rebuilt": plain DDP, whose fresh model starts again from its
# initial bucket layout while the run that never stopped is on the rebuilt one. "fixed": find_unused_parameters,
# one layout throughout (and no warm-up). "chained": a checkpoint after every step, one with no step in between.
RESUMES = {
    "rebuilt": ({}, [RESUME_AT, RESUME_STEPS]),
    "fixed": ({"find_unused_parameters": True}, [RESUME_AT, RESUME_STEPS]),
    "fixed-several": ({"find_unused_parameters": True, "bucket_cap_mb": models.SEVERAL_BUCKETS_MB},
                      [RESUME_AT, RESUME_STEPS]),
    "chained": ({}, [1, 1, 0, 1, 1]),
    "chained-static": ({"static_graph": True}, [1, 1, 0, 1, 1]),
}
FIXED_LAYOUT = ("fixed", "fixed-several")


def _resumed_run(name: str, kwargs: dict, schedule: list[int], seed: int) -> tuple[torch.Tensor, int]:
    """Train ``schedule[0]`` steps, then for each later entry: checkpoint (torch.save, then torch.load with
    weights_only=True), build a fresh model, DDP and hook from it, and train that many more steps."""
    model = models.ddp(models.mlp(seed), **kwargs)
    state = gcomp.install(model, name)
    models.train(model, schedule[0])
    done = schedule[0]
    for steps in schedule[1:]:
        buf = io.BytesIO()
        torch.save({"model": model.module.state_dict(), "hook": state.state_dict()}, buf)
        buf.seek(0)
        checkpoint = torch.load(buf, weights_only=True)
        fresh = models.mlp(seed + 1)  # other initial values: everything must come from the checkpoint
        fresh.load_state_dict(checkpoint["model"])
        model = models.ddp(fresh, **kwargs)
        state = gcomp.install(model, name)
        state.load_state_dict(checkpoint["hook"])
        models.train(model, steps, start=done)
        done += steps
    return models.flat_params(model.module).clone(), state.stats["steps"]


def job_resume(names: list[str], seed: int = 0) -> dict:
    """Contract 7: every ``RESUMES`` case against the same number of steps without stopping (2 ranks)."""
    out = {}
    for name in names:
        for flavour, (kwargs, schedule) in RESUMES.items():
            straight, straight_steps = _resumed_run(name, kwargs, [sum(schedule)], seed)
            resumed, resumed_steps = _resumed_run(name, kwargs, schedule, seed)
            out[(name, flavour)] = {"straight": straight, "resumed": resumed, "steps": sum(schedule),
                                    "straight_steps": straight_steps, "resumed_steps": resumed_steps}
    return out


def job_install_rejects(cases: list[tuple[str, dict]]) -> list:
    """Contract 8 at install time: each ``(name, params)`` must raise ValueError from ``gcomp.install`` and
    leave the DDP model free for a correct install afterwards. Returns ``(message or None, reinstalled)``."""
    out = []
    for name, params in cases:
        ddp_model = models.ddp(models.mlp(0))
        try:
            gcomp.install(ddp_model, name, **params)
            message = None
        except ValueError as err:
            message = str(err)
        try:
            gcomp.install(ddp_model, name)
            reinstalled = True
        except RuntimeError:
            reinstalled = False
        out.append((message, reinstalled))
    return out
