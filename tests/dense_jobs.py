"""Rank jobs for tests/test_dense.py: every registered method with parameters kept dense, checked against plain
DDP fed the same weights and batches."""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn

import gcomp
from tests.models import SEVERAL_BUCKETS_MB, batch, ddp, flat_params, mlp, train

STEPS = 4


def _reference_grads(model: nn.Module, ref: nn.Module, x, y) -> dict[str, torch.Tensor]:
    """Plain DDP's gradients at ``model``'s weights for the batch ``(x, y)``."""
    with torch.no_grad():
        for p, q in zip(model.parameters(), ref.parameters()):
            q.copy_(p)
    ref.zero_grad()
    nn.functional.cross_entropy(ref(x), y).backward()
    return {n: p.grad.clone() for n, p in ref.module.named_parameters()}


def train_dense(name: str, steps: int = STEPS, device: str = "cpu", **rule) -> dict:
    """``name`` installed with ``rule`` (``dense=``/``dense_below=``) on mlp, trained ``steps`` steps next to a plain
    DDP model: per step after the warm-up, the dense parameters whose gradient differs from plain DDP's (should be
    none); the stats; the parameters' sum (the same on every rank). ``device="cuda"``: on the rank's GPU."""
    if device == "cuda":
        device = f"cuda:{dist.get_rank() % torch.cuda.device_count()}"
    ids = {"device_ids": [device]} if device != "cpu" else {}
    model, ref = (ddp(mlp(0).to(device), bucket_cap_mb=SEVERAL_BUCKETS_MB, **ids) for _ in range(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one node (hierarchical, prunex), no masks (pactrain): said elsewhere
        state = gcomp.install(model, name, **rule)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    differ, checked, rank = [], 0, dist.get_rank()
    for step in range(steps):
        x, y = (t.to(device) for t in batch(step, rank))
        expected = _reference_grads(model, ref, x, y)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if step >= state.warmup:
            checked += 1
            differ += [(step, n) for n, p in model.module.named_parameters()
                       if n in state.dense_names and not torch.equal(p.grad, expected[n])]
        opt.step()
    return {"differ": differ, "checked": checked, "dense": sorted(state.dense_names), "stats": dict(state.stats),
            "warmup": state.warmup, "sum": float(flat_params(model).double().sum()), "loss": float(loss.detach())}


def every_method(**rule) -> dict:
    return {name: train_dense(name, **rule) for name in gcomp.available()}


def resumed_alike(names: list[str]) -> dict:
    """For each method, with ``dense=["*.bias"]`` on 2 and 3 buckets: the parameters of a run straight through
    equal those of the same run checkpointed after its step 2 and resumed on a fresh model (True)."""
    from tests.resume_jobs import AFTER, BUCKETS, PARAMS, _run

    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in names:
            params = {**PARAMS.get(name, {}), "dense": ["*.bias"]}
            for buckets in (2, 3):
                straight, stats = _run(name, params, BUCKETS[buckets], [2 + AFTER])
                resumed, again = _run(name, params, BUCKETS[buckets], [2, AFTER])
                out[(name, buckets)] = (torch.equal(straight, resumed), stats["dense_bytes"], again["dense_bytes"],
                                        again["dense_params"])
    return out


def method_calls(**rule) -> dict:
    """identity with ``rule`` on 3 buckets, its ``reduce`` recorded on one step after the warm-up: per call, the
    layout's names and whether it got the DDP bucket's own buffer; and the all-reduces launched that step."""
    model = ddp(mlp(0), bucket_cap_mb=0.001)
    state, gcomp_hook = gcomp.comm_hook("identity", model=model, **rule)
    calls, buffers = [], []
    reduce = state.method.reduce

    def recorded(buffer, info, group, stats):
        calls.append((info.names, buffer.data_ptr() in buffers))
        return reduce(buffer, info, group, stats)

    def hook(s, bucket):
        buffers.append(bucket.buffer().data_ptr())
        return gcomp_hook(s, bucket)

    state.method.reduce = recorded
    model.register_comm_hook(state, hook)
    train(model, 2)
    calls.clear()
    before = state.stats["allreduce_calls"]
    train(model, 1, start=2)
    return {"calls": calls, "allreduces": state.stats["allreduce_calls"] - before}


def last_layer(name: str, param: torch.Tensor) -> bool:
    """A predicate for ``dense=``: the output layer's parameters (importable, so a rank job can take it)."""
    return name.startswith("4.") and param.requires_grad


def loaded_without_a_rule() -> tuple:
    """topk checkpointed without a rule, loaded by a state with ``dense=["*.bias"]``: its ``dense_params``, and
    what the load warned."""
    model = ddp(mlp(0))
    state = gcomp.install(model, "topk", ratio=0.1)
    train(model, 2)
    saved = state.state_dict()
    fresh = ddp(mlp(0))
    again = gcomp.install(fresh, "topk", ratio=0.1, dense=["*.bias"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again.load_state_dict(saved)
    return again.stats["dense_params"], [str(w.message) for w in caught]
