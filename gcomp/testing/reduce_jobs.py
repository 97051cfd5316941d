"""The rank job of contracts 1, 4, 5, 6, 9 and 10: fake buckets fed to ``HookState.reduce`` on every rank, the
method on this rank alone (a one-rank group: what it does to one rank's input), draws of an unbiased method, and
one-parameter buckets' bytes. One call covers every configuration of one method; ``process_checks`` reads it."""
from __future__ import annotations

import collections
import copy

import torch
import torch.distributed as dist

import gcomp
from gcomp.collectives.reduce import ChainedCompressor
from gcomp.run_state import RunState
from gcomp.testing import fidelity, models
from gcomp.testing.buckets import DTYPES, LAYOUTS, FakeBucket, bucket_groups, dtype_name, fake_gradient
from gcomp.testing.source import MethodSource, as_source

PATHS = ("warmup", "compress")
NONFINITE = {"nan": float("nan"), "inf": float("inf")}
REDUCE_STEPS = 3  # fake-bucket steps per configuration (enough for error feedback to carry a residual)
CONSERVATION_STEPS = 6  # the last three on DDP's rebuilt layout: what is held back follows the parameters
BYTES_PARAMS = ("0.weight", "4.bias")  # one-parameter buckets of 640 and 10 entries
ALONE = ("largest", "contraction")
_single: list = []


def _seed(*parts: int) -> int:
    value = 0
    for p in parts:
        value = value * 1009 + p
    return value


def _gather(t: torch.Tensor) -> torch.Tensor:
    """Every rank's ``t``, stacked in rank order, as float64."""
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return torch.stack([o.double() for o in out])


def alone_group() -> dist.ProcessGroup:
    """This rank alone, as a process group (every rank makes every rank's, once per process)."""
    if not _single:
        _single.extend(dist.new_group([r]) for r in range(dist.get_world_size()))
    return _single[dist.get_rank()]


def joined(source: MethodSource, model, group) -> tuple:
    """A fresh method of ``source`` bound to ``group`` as a state binds it, and its stats."""
    state = RunState(source.create(), group)
    state.join(model)
    return state.method, state.stats


def decode_alone(method: gcomp.Method, payload: gcomp.Payload) -> torch.Tensor:
    """``payload`` decoded as if its rank were the only one (a chained payload's first round is its own)."""
    codec = method.compressor
    if isinstance(codec, ChainedCompressor) and codec.chained(payload):
        codec.second_round(payload)
    return codec.decode(method._own(payload.tensors), payload.ctx)


def _reduce_bucket(state: gcomp.HookState, bucket: FakeBucket, warming_up: bool, fresh) -> dict:
    """Feed one bucket to the hook; returns the pending result and this rank's part of the expectations.

    On the compressing path, a copy of the method (the hook's is left alone) takes the bucket as the hook does:
    its input with error feedback (``v``), its payload decoded alone (``decoded``; their sum over ranks is the
    mean of what the ranks sent, for methods that ``decodes_alone``). ``alone``: a fresh method on this rank alone
    (``fresh``), held to the error models that speak of one rank's input."""
    world, method = dist.get_world_size(), state.method
    raw = bucket.buffer().clone()
    out = {"raw": raw, "decoded": raw.clone().mul_(1.0 / world) if warming_up else None, "v": None,
           "dtypes": [raw.dtype], "alone": None}
    if not warming_up and isinstance(method, gcomp.Method):
        info, twin, kind = state.bucket_info(bucket), copy.deepcopy(method), method.traits.fidelity
        s = raw.clone().mul_(1.0 / world)
        out["v"] = twin.memory.compensate(s, info)
        payload = twin._send(s.clone(), info, collections.defaultdict(float))
        out["dtypes"] += [t.dtype for t in payload.tensors]
        if method.decodes_alone:
            out["decoded"] = decode_alone(twin, payload)
        if kind.kind in ALONE:
            single = copy.deepcopy(fresh[0])
            c = single.reduce(s.clone(), info, alone_group(), fresh[1]).wait()
            out["alone"] = fidelity.check_alone(kind, s.double(), c.double(), "its bucket reduced on this rank alone")
    out["fut"] = state.reduce(bucket)
    return out


def _check(pending: dict, where: str, method) -> dict:
    """Wait for one bucket and check it (collective: every rank calls it in the same order). Every rank reports
    its result's shape, dtype and device next to the bucket's, and its ``alone`` message; rank 0 which ranks' results
    differ from its own and, as messages (None when fine), how far the result is from the mean of the payloads
    decoded alone (``mean``: ``"not checked"`` without a codec), from the dense mean (``dense``) and from the error
    model (``fidelity``)."""
    result = pending["fut"].wait()
    raw, world = pending["raw"], dist.get_world_size()
    report = {"shape": tuple(result.shape), "dtype": result.dtype, "device": str(result.device),
              "bucket": (tuple(raw.shape), raw.dtype, str(raw.device)), "fidelity": pending["alone"]}
    results = _gather(result.to(raw.dtype).reshape(raw.shape))
    decoded = _gather(pending["decoded"]) if pending["decoded"] is not None else None
    v = _gather(pending["v"]) if pending["v"] is not None else None
    raws = _gather(raw)
    if dist.get_rank() == 0:
        eps, tiny = fidelity.precision(pending["dtypes"])
        report["differ"] = [r for r in range(world) if not torch.equal(results[r], results[0])]
        report["mean"] = "not checked" if decoded is None else fidelity.mismatch(
            result, decoded.sum(0), fidelity.sum_bound(world, decoded.abs().sum(0), eps, tiny),
            f"{where}: mean of the payloads")
        report["dense"] = fidelity.mismatch(result, raws.sum(0) / world,
                                            fidelity.sum_bound(world + 1, raws.abs().sum(0) / world, eps, tiny),
                                            f"{where}: dense mean")
        kind = method.traits.fidelity if isinstance(method, gcomp.Method) else None
        if v is not None and kind.kind in ("exact", "relative"):
            report["fidelity"] = fidelity.check_sum(kind, result.reshape(-1), v, pending["dtypes"], "the mean")
    return report


def _state(source: MethodSource, ddp_model, path: str) -> gcomp.HookState:
    state = gcomp.HookState(source.create(), ddp_model, None)
    state.warmup = 10**9 if path == "warmup" else 0
    return state


def _draws(method, names: list[str], numels: list[int], seed: int) -> str | None:
    """Contract 9 for an unbiased method: the mean of ``fidelity.DRAWS`` reductions of one fp32 bucket, each a
    fresh step (what error feedback held is flushed first), against the exact mean."""
    world = dist.get_world_size()
    info = gcomp.BucketInfo.from_layout(0, torch.float32, names, numels)
    x = torch.randn(info.numel, generator=torch.Generator().manual_seed(_seed(seed, dist.get_rank()))) / world
    inputs, stats = _gather(x), collections.defaultdict(float)
    total, squares = torch.zeros(info.numel, dtype=torch.float64), torch.zeros(info.numel, dtype=torch.float64)
    for _ in range(fidelity.DRAWS):
        if method.error_feedback:
            method.flush(info, x)
        r = method.reduce(x.clone(), info, None, stats).wait().double()
        total, squares = total + r, squares + r * r
    return fidelity.check_draws(total, squares, fidelity.DRAWS, inputs.sum(0), inputs.abs().sum(0),
                                [torch.float32], f"ws{world}")


def _conservation(source: MethodSource, model, dtype: torch.dtype) -> str | None:
    """Contract 5 on this rank alone: the result plus what is held back after a step (``Method.flush`` of a
    copy) is the gradient plus what was held before it, step after step, across a re-layout."""
    method, stats = joined(source, model, alone_group())
    sizes = {"4.weight": 320, "0.bias": 32, "4.bias": 10}
    layouts = [gcomp.BucketInfo.from_layout(0, dtype, list(sizes), list(sizes.values())),
               gcomp.BucketInfo.from_layout(0, dtype, list(sizes)[::-1], list(sizes.values())[::-1])]
    g = torch.Generator().manual_seed(1)

    def held(info):
        out = copy.deepcopy(method).flush(info, torch.zeros(info.numel, dtype=dtype))
        return torch.zeros(info.numel, dtype=dtype) if out is None else out.reshape(-1).to(dtype)

    for step in range(CONSERVATION_STEPS):
        info = layouts[step // 3]
        grad = (torch.randn(info.numel, generator=g, dtype=torch.float64) * 10.0 ** (step - 2)).to(dtype)
        v = grad + held(info)  # what compensate makes of it
        sent = method.reduce(grad.clone(), info, alone_group(), stats).wait().double()
        new = held(info).double()
        off = fidelity.mismatch(sent + new, v.double(), torch.finfo(dtype).eps * new.abs(),
                                f"step {step}: sent + now held vs gradient + held before")
        if off is not None:
            return off
        if step == 2 and not new.abs().sum() > 0:
            return "a lossy error-feedback method held nothing back"
    return None


def job_reduce(method: str | MethodSource, seed: int = 0) -> dict:
    """Contracts 1, 4, 5, 6, 9 and 10. Returns ``{(path, layout, dtype_name): [[bucket report, ...] per step]}``,
    ``{("nonfinite", path, kind): whether this rank's result is all finite}``, ``("unbiased",)``,
    ``("conservation", dtype_name)``: a message or None, and ``("bytes", n)``: the bytes of each of two steps."""
    source = as_source(method)
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for dtype in DTYPES:
        ddp_model = models.ddp(models.mlp(seed).to(dtype))
        fresh = joined(source, ddp_model.module, alone_group())
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
                        pending.append(_reduce_bucket(state, bucket, path == "warmup", fresh))
                    steps.append([_check(p, f"{key} step {step} bucket {i}", state.method)
                                  for i, p in enumerate(pending)])
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
    state = _state(source, ddp_model, "compress")
    method, params = state.method, dict(ddp_model.module.named_parameters())
    if not isinstance(method, gcomp.Method):
        return out
    if method.traits.fidelity.kind == "unbiased":
        out[("unbiased",)] = _draws(method, ["4.weight", "4.bias"], [320, 10], seed)
    if method.error_feedback and set(method.traits.slots) <= set(method.traits.held):
        for dtype in DTYPES:
            out[("conservation", dtype_name(dtype))] = _conservation(source, ddp_model.module, dtype)
    if method.traits.wire_bytes is not None:
        for name in BYTES_PARAMS:
            sent = []
            for step in range(2):
                before = state.stats["bytes_sent"]
                grad = fake_gradient([params[name]], torch.float32, seed=_seed(seed + 3, step, rank))
                state.reduce(FakeBucket(grad, 0, True, [params[name]])).wait()
                sent.append(state.stats["bytes_sent"] - before)
            out[("bytes", params[name].numel())] = sent
    return out
