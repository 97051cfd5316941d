"""The rank jobs that reduce, read by ``process_checks``: ``job_reduce`` (contracts 1, 4, 5, 6, 9 and 10: fake buckets
fed to ``HookState.reduce``, their bytes, the method on this rank alone, draws of an unbiased method) and ``job_fsdp``
(contract 11: FSDP2's reduce-scatter called as FSDP calls it, ``state.comms[0]``)."""
from __future__ import annotations

import collections
import copy
import functools

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
ALONE = ("largest", "contraction")
FSDP_CHECKS = ("fidelity", "conservation", "nonfinite", "avg")
FSDP_STEPS = 3  # calls of one input: error feedback carries residuals on
_single: list = []


def _seed(*parts: int) -> int:
    return functools.reduce(lambda value, part: value * 1009 + part, parts, 0)


def gather(t: torch.Tensor) -> torch.Tensor:
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


def _launch(state: gcomp.HookState, bucket: FakeBucket, warming_up: bool, fresh) -> dict:
    """One bucket to the hook; on the compressing path a copy of the method takes it as the hook does: its input
    with error feedback (``v``), its payload decoded alone (``decoded``); and a ``fresh`` method on this rank alone."""
    world, method = dist.get_world_size(), state.method
    raw = bucket.buffer().clone()
    out = {"raw": raw, "decoded": raw.clone().mul_(1.0 / world) if warming_up else None, "v": None,
           "dtypes": [raw.dtype], "alone": None, "bytes": None}
    if not warming_up and isinstance(method, gcomp.Method):
        info, twin, kind = state.bucket_info(bucket), copy.deepcopy(method), method.traits.fidelity
        s = raw.clone().mul_(1.0 / world)
        if kind.kind in ("exact", "relative"):  # the bucket and what the method held back: memory and held slots
            held = copy.deepcopy(method).flush(info, s)
            out["v"] = s if held is None else s + held.reshape(-1)
        payload = twin._send(s.clone(), info, collections.defaultdict(float))
        out["dtypes"] += [t.dtype for t in payload.tensors]
        if method.decodes_alone:
            out["decoded"] = decode_alone(twin, payload)
        if kind.kind in ALONE:
            c = copy.deepcopy(fresh[0]).reduce(s.clone(), info, alone_group(), fresh[1]).wait()
            out["alone"] = fidelity.check_alone(kind, s.double(), c, "its bucket reduced on this rank alone")
        if method.traits.wire_bytes is not None:
            out["bytes"] = [-state.stats["bytes_sent"], method.traits.wire_bytes(info, world)]
    out["fut"] = state.reduce(bucket)
    if out["bytes"] is not None:
        out["bytes"][0] += state.stats["bytes_sent"]
    return out


def _check(pending: dict, where: str, method) -> dict:
    """Wait for one bucket and report (every rank, in the same order) its result's shape, dtype, device, and on rank 0
    the ranks whose result differs and messages (None when fine): ``mean`` of the payloads, ``dense``, ``fidelity``."""
    result = pending["fut"].wait()
    raw, world = pending["raw"], dist.get_world_size()
    report = {"shape": tuple(result.shape), "dtype": result.dtype, "device": str(result.device),
              "bucket": (tuple(raw.shape), raw.dtype, str(raw.device)), "fidelity": pending["alone"],
              "bytes": pending["bytes"]}
    results, raws = gather(result.to(raw.dtype).reshape(raw.shape)), gather(raw)
    decoded, v = [None if pending[k] is None else gather(pending[k]) for k in ("decoded", "v")]
    if dist.get_rank() == 0:
        eps, tiny = fidelity.precision(pending["dtypes"])
        report["differ"] = [r for r in range(world) if not torch.equal(results[r], results[0])]
        report["mean"] = "not checked" if decoded is None else fidelity.mismatch(
            result, decoded.sum(0), fidelity.sum_bound(world, decoded.abs().sum(0), eps, tiny),
            f"{where}: mean of the payloads")
        report["dense"] = fidelity.mismatch(result, raws.sum(0) / world,
                                            fidelity.sum_bound(world + 1, raws.abs().sum(0) / world, eps, tiny),
                                            f"{where}: dense mean")
        if v is not None and method.traits.fidelity.kind in ("exact", "relative"):
            report["fidelity"] = fidelity.check_sum(method.traits.fidelity, result.reshape(-1), v,
                                                    pending["dtypes"], "the mean")
    return report


def _state(source: MethodSource, ddp_model, path: str) -> gcomp.HookState:
    state = gcomp.HookState(source.create(), ddp_model, None)
    state.warmup = 10**9 if path == "warmup" else 0
    return state


def _draws(method, seed: int) -> str | None:
    """Contract 9, unbiased: ``fidelity.DRAWS`` reductions of one fp32 bucket, what was held flushed before each."""
    info = gcomp.BucketInfo.from_layout(0, torch.float32, ["4.weight", "4.bias"], [320, 10])
    g = torch.Generator().manual_seed(_seed(seed, dist.get_rank()))
    x = torch.randn(info.numel, generator=g) / dist.get_world_size()
    draws = []
    for _ in range(fidelity.DRAWS):
        if method.error_feedback:
            method.flush(info, x)
        draws.append(method.reduce(x.clone(), info, None, collections.defaultdict(float)).wait().double())
    return fidelity.check_draws(torch.stack(draws), gather(x), [torch.float32], f"ws{dist.get_world_size()}",
                                method.traits.fidelity.bound)


def _conservation(source: MethodSource, model, dtype: torch.dtype) -> str | None:
    """Contract 5 on this rank alone, step after step, across a re-layout (what is held: ``Method.flush`` of a copy)."""
    method, stats = joined(source, model, alone_group())
    sizes = {"4.weight": 320, "0.bias": 32, "4.bias": 10}
    layouts = [gcomp.BucketInfo.from_layout(0, dtype, names, [sizes[n] for n in names])
               for names in (list(sizes), list(sizes)[::-1])]
    g = torch.Generator().manual_seed(1)

    def held(info):  # in its own dtype (a slot may be kept wider than the bucket)
        out = copy.deepcopy(method).flush(info, torch.zeros(info.numel, dtype=dtype))
        return torch.zeros(info.numel, dtype=dtype) if out is None else out.reshape(-1)

    for step in range(CONSERVATION_STEPS):
        info = layouts[step // 3]
        grad = (torch.randn(info.numel, generator=g, dtype=torch.float64) * 10.0 ** (step - 2)).to(dtype)
        v = grad + held(info)  # what compensate makes of it
        sent = method.reduce(grad.clone(), info, alone_group(), stats).wait().double()
        new = held(info).double()  # slack: the rounding of what is held, and of the result to the bucket's dtype
        off = fidelity.mismatch(sent + new, v.double(), torch.finfo(dtype).eps * (new.abs() + sent.abs()),
                                f"step {step}: sent + now held vs gradient + held before")
        if off is not None or (step == 2 and not new.abs().sum() > 0):
            return off or "a lossy error-feedback method held nothing back"
    return None


def job_reduce(method: str | MethodSource, seed: int = 0) -> dict:
    """Contracts 1, 4, 5, 6, 9 and 10: ``{(path, layout, dtype_name): [[bucket report, ...] per step]}``,
    ``{("nonfinite", path, kind): this rank's result all finite}``, ``("unbiased",)`` and ``("conservation",
    dtype_name)``: a message or None."""
    source = as_source(method)
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for dtype in DTYPES:
        ddp_model = models.ddp(models.mlp(seed).to(dtype))
        fresh = joined(source, ddp_model.module, alone_group())
        for path in PATHS:
            for layout in LAYOUTS:
                state, groups = _state(source, ddp_model, path), bucket_groups(ddp_model.module, layout)
                key, steps = (path, layout, dtype_name(dtype)), []
                for step in range(REDUCE_STEPS):  # like DDP: every bucket launched before any is waited for
                    pending = [_launch(state, FakeBucket(fake_gradient(params, dtype, _seed(seed, step, rank, i)), i,
                                                         i == len(groups) - 1, params), path == "warmup", fresh)
                               for i, params in enumerate(groups)]
                    steps.append([_check(p, f"{key} step {step} bucket {i}", state.method)
                                  for i, p in enumerate(pending)])
                out[key] = steps
    ddp_model = models.ddp(models.mlp(seed))
    groups = bucket_groups(ddp_model.module, "several")
    for path in PATHS:  # contract 6: the last rank holds a non-finite entry in bucket 0 of the second step
        for kind, bad in NONFINITE.items():
            state = _state(source, ddp_model, path)
            for step in range(2):
                grads = [fake_gradient(params, torch.float32, _seed(seed + 7, step, rank, i))
                         for i, params in enumerate(groups)]
                if step == 1 and rank == world - 1:
                    grads[0][grads[0].numel() // 3] = bad
                futures = [state.reduce(FakeBucket(grad, i, i == len(groups) - 1, params))
                           for i, (grad, params) in enumerate(zip(grads, groups))]
                results = [f.wait() for f in futures]
            out[("nonfinite", path, kind)] = bool(torch.isfinite(results[0]).all())
    state = _state(source, ddp_model, "compress")
    method = state.method
    if not isinstance(method, gcomp.Method):
        return out
    if method.traits.fidelity.kind == "unbiased":
        out[("unbiased",)] = _draws(method, seed)
    if method.error_feedback and set(method.traits.slots) <= set(method.traits.held):
        for dtype in DTYPES:
            out[("conservation", dtype_name(dtype))] = _conservation(source, ddp_model.module, dtype)
    return out


def _call(comm, x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    out = torch.full((x.numel() // dist.get_world_size(),), float("nan"), dtype=x.dtype)
    comm(out, x.clone(), dist.group.WORLD, op)
    return out


def _alone(source: MethodSource, method, layout, x: torch.Tensor) -> str | tuple | None:
    """``largest`` and ``contraction`` on each row this rank sends, reduced on this rank alone."""
    if method.traits.rows == "native":
        return ("skip", "a native rows codec has no rows to reduce alone")
    single, stats = joined(source, None, alone_group())
    for r, p in enumerate(x.view(layout.world, -1)):
        c = copy.deepcopy(single).reduce(p.clone(), layout.row(r), alone_group(), stats).wait()
        off = fidelity.check_alone(method.traits.fidelity, p.double(), c.reshape(-1), f"row {r} alone")
        if off is not None:
            return off
    return None


def _fsdp_draws(comm, method, layout, mask, kind, dtypes) -> str | None:
    """Contract 11, unbiased: ``fidelity.DRAWS`` calls on a plain normal input (zero where pruned), whatever was held
    back flushed before each, as under DDP (the spread is the widest entry's: on inputs four decades apart no count of
    draws would bound the small ones)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    y = torch.randn(layout.numel, generator=torch.Generator().manual_seed(_seed(1, rank)))
    if mask is not None:
        y *= mask.reshape(-1)
    draws = []
    for _ in range(fidelity.DRAWS):
        method.flush(layout.pieces, y)  # whatever the method holds back, a memory's or a codec's carry
        draws.append(_call(comm, y).double())
    rows = gather(y).view(world, world, -1)[:, rank]
    return fidelity.check_draws(torch.stack(draws), rows, dtypes, "this rank's shard", kind.bound)


def job_fsdp(sources: list[MethodSource]) -> dict:
    """Per method (by label): ``checks`` (None, a message, or ``("skip", reason)`` per ``FSDP_CHECKS``), first and
    last call's shard, each call's bytes, the stats, the pruned mask (a method that reads the model gets a pruned
    one) and the method's state after the calls."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for source in sources:
        model = models.fsdp_mlp(source.create().reads_model)
        state = source.install(model)
        comm, method = state.comms[0], state.method
        numel = world * sum(-(-p.size(0) // world) * p.size()[1:].numel() for p in model[0].parameters())
        x = torch.randn(numel, generator=torch.Generator().manual_seed(rank)).mul_(torch.logspace(-2, 2, numel))
        layout, mask = comm.layout_for(x, dist.group.WORLD), None
        if method.reads_model:  # zero where pruned, every rank alike (weight_orig * weight_mask), and FSDP's padding
            mask = layout.shard_major([getattr(model[0], "weight_mask", None) if n.endswith("weight_orig") else None
                                       for n in layout.names], 1.0, 0.0, torch.float32, "cpu")
            x *= mask.reshape(-1)
        inputs = gather(x)
        rows, total = inputs.view(world, world, -1)[:, rank], inputs.sum(0)
        kind = method.traits.fidelity if isinstance(method, gcomp.Method) else None
        dtypes = [x.dtype] + ([] if getattr(kind, "kind", None) != "relative" else [t.dtype for t in copy.deepcopy(
            method)._send(x.clone(), layout, collections.defaultdict(float)).tensors])
        calls, call_bytes = [], []
        for _ in range(FSDP_STEPS):
            before = state.stats["bytes_sent"]
            calls.append(_call(comm, x))
            call_bytes.append(state.stats["bytes_sent"] - before)
        saved = method.state_dict()
        checks = {"fidelity": ("skip", f"{type(method).__name__} declares no error model"),
                  "conservation": ("skip", "applies to methods with error feedback"),
                  "avg": ("skip", "AVG is checked for exact and relative error models")}
        if method.error_feedback:  # what every rank holds back after the calls, handed back (the draws start afresh)
            held = method.flush(layout.pieces, x)
            conserved = gather(torch.stack(calls).sum(0)).reshape(-1) + (0 if held is None else gather(
                held.reshape(-1)).sum(0))
            expected = total * FSDP_STEPS
            checks["conservation"] = fidelity.mismatch(conserved, expected, 1e-3 + 1e-4 * expected.abs(),
                                                       f"{FSDP_STEPS} calls' shards and what every rank holds back "
                                                       "after them vs the sum of the inputs")
        if kind is not None and kind.kind == "unbiased":
            checks["fidelity"] = _fsdp_draws(comm, method, layout, mask, kind, dtypes)
        elif kind is not None and kind.kind in ALONE:
            checks["fidelity"] = _alone(source, method, layout, x)
        elif kind is not None:
            checks["fidelity"] = fidelity.check_sum(kind, calls[0].double(), rows, dtypes, "this rank's shard")
        bad = x.clone()
        if rank == 0:
            bad.view(world, -1)[world - 1][0] = float("nan")
        nan = bool(torch.isnan(_call(comm, bad)).any())
        checks["nonfinite"] = None if nan or rank != world - 1 else f"a NaN in rank 0's row {rank} did not reach it"
        avg = _call(comm, x, dist.ReduceOp.AVG)
        if kind is not None and kind.kind in ("exact", "relative"):
            checks["avg"] = fidelity.check_sum(kind, avg.double(), rows / world, dtypes,
                                               "AVG: the shard of the sum divided by the shard count")
        out[source.label] = {"checks": checks, "first": calls[0], "last": calls[-1], "call_bytes": call_bytes,
                             "stats": dict(state.stats), "mask": mask, "own_mask": None if mask is None else mask[rank],
                             "sizes": list(layout.sizes), "state": saved}
    return out
