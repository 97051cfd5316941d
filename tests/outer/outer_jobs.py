"""Rank jobs of tests/outer (module level, so that worker processes can import them)."""
from __future__ import annotations

import gc
from datetime import timedelta

import torch
import torch.distributed as dist

import gcomp
import gcomp.outer
from tests import models


def _sgd1(params):
    return torch.optim.SGD(params, lr=1.0)


def _inner_step(model, opt, step: int, rank: int) -> None:
    x, y = models.batch(step, rank)
    torch.nn.functional.cross_entropy(model(x.to(next(model.parameters()).dtype)), y).backward()
    opt.step()
    opt.zero_grad()


def job_like_ddp(steps: int) -> list[float]:
    """sync_every=1, identity, outer SGD lr 1, inner SGD: the largest relative distance to synchronous DDP's
    parameters, at every step."""
    rank = dist.get_rank()
    reference = models.ddp(models.mlp(0))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    model = models.mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = gcomp.outer.DiLoCo(model, sync_every=1, method="identity", outer_optimizer=_sgd1)
    distances = []
    for step in range(steps):
        _inner_step(reference, ref_opt, step, rank)
        _inner_step(model, opt, step, rank)
        assert outer.step()
        a, b = models.flat_params(model), models.flat_params(reference.module)
        distances.append(float((a - b).norm() / b.norm()))
    assert outer.stats["outer_steps"] == steps and outer.stats["inner_steps"] == steps
    return distances


def job_conservation(steps: int, sync_every: int) -> dict:
    """float64, topk with error feedback on the outer gradient: per bucket, the sum of the reduced outer gradients
    applied, the sum over ranks of the outer gradients handed to the method (already divided by the world size),
    and the sum over ranks of what the method still holds back."""
    rank = dist.get_rank()
    model = models.mlp(0).to(torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = gcomp.outer.DiLoCo(model, sync_every=sync_every, method="topk:ratio=0.1", bucket_mb=0.002)
    infos = [b.info for f in outer.layout for b in f]
    given = [torch.zeros(i.numel, dtype=torch.float64) for i in infos]
    sent = [torch.zeros(i.numel, dtype=torch.float64) for i in infos]
    reduce = outer.method.reduce

    def recording(buffer, info, group, stats):
        given[info.index] += buffer
        return reduce(buffer, info, group, stats).then(lambda f: _add(sent[info.index], f.value()))

    outer.method.reduce = recording
    for step in range(steps):
        _inner_step(model, opt, step, rank)
        outer.step()
    held = [outer.method.flush(i, g) for i, g in zip(infos, given)]
    held = [torch.zeros_like(g) if h is None else h.reshape(-1) for h, g in zip(held, given)]
    for t in given + held:
        dist.all_reduce(t)
    return {"sent": sent, "given": given, "held": held, "outer_steps": outer.stats["outer_steps"],
            "bytes_sent": outer.stats["bytes_sent"], "bytes_dense": outer.stats["bytes_dense"]}


def _add(total: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    total += value.reshape(-1)
    return value


def job_streaming(steps: int, **kw) -> dict:
    """Streaming DiLoCo with topk: every rank's parameters after every step that applied a fragment, and when."""
    rank = dist.get_rank()
    model = models.mlp(rank)  # different initial weights: DiLoCo starts every rank from rank 0's
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = gcomp.outer.DiLoCo(model, method="topk:ratio=0.2", **kw)
    start = models.flat_params(model).clone()
    acted, after = [], []
    for step in range(steps):
        _inner_step(model, opt, step, rank)
        if outer.step():
            acted.append(step + 1)
        after.append(torch.cat([t.detach().reshape(-1) for t in outer.theta]).clone())
    return {"start": start, "acted": acted, "theta": after, "stats": dict(outer.stats),
            "params": models.flat_params(model).clone(),
            "fragments": [[n for b in f for n in b.info.names] for f in outer.layout]}


def _run(model, opt, outer, start: int, steps: int) -> None:
    rank = dist.get_rank()
    for step in range(start, start + steps):
        _inner_step(model, opt, step, rank)
        outer.step()


def _made(world_seed: int = 0, **kw):
    model = models.mlp(world_seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = gcomp.outer.DiLoCo(model, method="topk:ratio=0.2", **kw)
    return model, opt, outer


def job_resume(k: int, **kw) -> dict:
    """2k steps straight, against k steps, a checkpoint (through torch.save, weights_only load), fresh objects and
    k more: the parameters and the global copy of both."""
    import io

    model, opt, outer = _made(**kw)
    _run(model, opt, outer, 0, 2 * k)
    straight = (models.flat_params(model).clone(), [t.detach().clone() for t in outer.theta], dict(outer.stats))
    model, opt, outer = _made(**kw)
    _run(model, opt, outer, 0, k)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "outer": outer.state_dict()}, buffer)
    saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    model, opt, outer = _made(**kw)
    model.load_state_dict(saved["model"])
    outer.load_state_dict(saved["outer"])
    _run(model, opt, outer, k, k)
    resumed = (models.flat_params(model).clone(), [t.detach().clone() for t in outer.theta], dict(outer.stats))
    return {"straight": straight, "resumed": resumed}


def job_save_gathered(path: str, steps: int) -> dict:
    """``steps`` steps (a multiple of sync_every: the model is the global copy), every rank's state to ``path``."""
    model, opt, outer = _made(sync_every=4)
    _run(model, opt, outer, 0, steps)
    state = outer.gather_state_dict(dst=0)
    if dist.get_rank() == 0:
        torch.save({"model": model.state_dict(), "outer": state}, path)
    return {"params": models.flat_params(model).clone()}


def job_resume_resized(path: str, steps: int) -> dict:
    saved = torch.load(path, weights_only=True)
    model, opt, outer = _made(sync_every=4)
    model.load_state_dict(saved["model"])
    outer.load_state_dict(saved["outer"])
    loaded = models.flat_params(model).clone()
    _run(model, opt, outer, steps, 8)
    return {"loaded": loaded, "params": models.flat_params(model).clone(), "iteration": outer.iteration,
            "theta": torch.cat([t.detach().reshape(-1) for t in outer.theta])}


def job_bad_agreement(field: str) -> str:
    """One rank builds its DiLoCo differently; what each rank raised."""
    rank = dist.get_rank()
    kw = {"sync_every": 4, "method": "topk:ratio=0.1", "fragments": 1}
    if rank == dist.get_world_size() - 1:
        kw[field] = {"sync_every": 5, "method": "topk:ratio=0.2", "fragments": 2}[field]
    try:
        gcomp.outer.DiLoCo(models.mlp(0), **kw)
    except ValueError as err:
        return str(err)
    return "no error"


def job_peer_dies(sync_every: int) -> dict:
    """On a fresh group with a 3 s timeout, the last rank leaves before the first outer sync: what each survivor
    saw when it reached the sync."""
    from tests.failure_jobs import _new_groups

    from torch.distributed import distributed_c10d
    rank, world = dist.get_rank(), dist.get_world_size()
    before = set(distributed_c10d._world.pg_map)
    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=3))
    model = models.mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = gcomp.outer.DiLoCo(model, sync_every=sync_every, method="topk:ratio=0.1", group=group)
    out = {"error": None, "steps": 0}
    if rank == world - 1:
        del outer, group
        gc.collect()
        for g in _new_groups(before):
            dist.destroy_process_group(g)
        out["died"] = True
        dist.barrier()
        return out
    try:
        for step in range(sync_every):
            _inner_step(model, opt, step, rank)
            outer.step()
            out["steps"] += 1
    except Exception as err:  # noqa: BLE001 -- what the survivor saw is the result
        out["error"] = f"{type(err).__name__}: {err}"
    del outer, group
    gc.collect()
    for g in _new_groups(before):
        dist.destroy_process_group(g)
    dist.barrier()
    return out


def job_nodes(steps: int) -> dict:
    """4 ranks as 2 nodes of 2: an inner DDP over each node, the outer reduction over the ranks of the same local
    rank (0 with 2, 1 with 3); each rank's parameters after every outer step."""
    rank = dist.get_rank()
    nodes = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    across = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    inner, outer_group = nodes[rank // 2], across[rank % 2]
    model = models.ddp(models.mlp(0), process_group=inner)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = gcomp.outer.DiLoCo(model, sync_every=3, method="topk:ratio=0.3", group=outer_group, inner_group=inner)
    seen = []
    for step in range(steps):
        _inner_step(model, opt, step, rank)
        if outer.step():
            seen.append(models.flat_params(model.module).clone())
    return {"seen": seen, "stats": dict(outer.stats)}



def job_tampered(name: str) -> str:
    """The last rank changes one entry of the global copy of ``name`` before an outer step: what each rank
    raised there."""
    rank = dist.get_rank()
    model, opt, outer = _made(sync_every=2)
    _run(model, opt, outer, 0, 1)
    if rank == dist.get_world_size() - 1:
        for b in (b for f in outer.layout for b in f):
            if name in b.info.names:
                at = b.info.offsets[b.info.names.index(name)]
                with torch.no_grad():
                    outer.theta[b.info.index][at + 1] += 1e-3
    try:
        _run(model, opt, outer, 1, 1)
    except RuntimeError as err:
        return str(err)
    return "no error"


def job_every_method(names: list[str], steps: int) -> dict:
    """Each method on the outer loop (sync_every=2): its parameters after ``steps`` steps, or its error."""
    rank = dist.get_rank()
    out = {}
    for name in names:
        model = models.mlp(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        try:
            outer = gcomp.outer.DiLoCo(model, sync_every=2, method=name, bucket_mb=0.002)
            for step in range(steps):
                _inner_step(model, opt, step, rank)
                outer.step()
            out[name] = {"params": models.flat_params(model).clone(), "outer_steps": outer.stats["outer_steps"],
                         "sent": outer.stats["bytes_sent"]}
        except Exception as err:  # noqa: BLE001 -- the test names it
            out[name] = {"error": f"{type(err).__name__}: {err}"}
        dist.barrier()
    return out
