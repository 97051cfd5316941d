"""Rank jobs for tests/test_agreement.py: each rank installs or loads what its index in a list says, and reports
what happened (``("ok", detail)`` or ``(exception type, message)``)."""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn

import gcomp
from gcomp import agreement
from gcomp.registry import from_spec
from tests.models import ddp, flat_params, mlp, train


def _outcome(call) -> tuple:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            detail = call()
        except Exception as err:  # noqa: BLE001 -- the test inspects it
            return type(err).__name__, str(err)
    said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    return ("warns", " | ".join(said)) if said else ("ok", detail)


def install_per_rank(specs: list[str], steps: int = 2) -> tuple:
    """Rank r installs ``specs[r]`` on the same DDP model and trains: the parameters' sum, or the error."""
    def call():
        model = ddp(mlp(0))
        gcomp.install(model, from_spec(specs[dist.get_rank()]))
        train(model, steps)
        return float(flat_params(model).double().sum())
    return _outcome(call)


class _Renamed(nn.Module):
    """``mlp``'s parameters, alike in shape, under other names."""

    def __init__(self):
        super().__init__()
        base = mlp(0)
        self.first, self.act, self.middle, self.act2, self.last = base

    def forward(self, x):
        return self.last(self.act2(self.middle(self.act(self.first(x)))))


def install_renamed_on(renamed_rank: int) -> tuple:
    model = ddp(_Renamed() if dist.get_rank() == renamed_rank else mlp(0))
    return _outcome(lambda: gcomp.install(model, "topk", ratio=0.1) and None)


def comm_hook_groups(groups: list[list[int]], bind: bool) -> tuple:
    """Every rank builds every group (``new_group`` is collective), then registers a comm_hook over
    ``groups[rank]`` on a DDP model over all ranks, bound to it or not, and trains: the parameters' sum or the
    error."""
    made = {tuple(g): dist.new_group(g) for g in {tuple(g) for g in groups}}
    mine = made[tuple(groups[dist.get_rank()])]

    def call():
        model = ddp(mlp(0))
        state, hook = gcomp.comm_hook("fp16", process_group=mine, model=model if bind else None)
        model.register_comm_hook(state, hook)
        train(model, 2)
        return float(flat_params(model).double().sum())
    out = _outcome(call)
    dist.barrier()
    return out


def comm_hook_not_member(group_ranks: list[int]) -> tuple:
    group = dist.new_group(group_ranks)
    return _outcome(lambda: gcomp.comm_hook("fp16", process_group=group) and None)


def load_per_rank(later: int = -1, refuse_on: int = -1) -> tuple:
    """Every rank trains ``topk`` for 3 steps, saves, and loads its own state (rank ``later`` a state one step
    later, rank ``refuse_on`` one of another method)."""
    model = ddp(mlp(0))
    state = gcomp.install(model, "topk", ratio=0.1)
    train(model, 3)
    saved = state.state_dict()
    if dist.get_rank() == later:
        saved = {**saved, "iteration": saved["iteration"] + 1}
    if dist.get_rank() == refuse_on:
        saved = {**saved, "method": "randomk"}
    return _outcome(lambda: gcomp.install(ddp(mlp(0)), "topk", ratio=0.1).load_state_dict(saved))


def agree_fields(fields_per_rank: list[dict]) -> tuple:
    return _outcome(lambda: agreement.agree("probe", fields_per_rank[dist.get_rank()], None,
                                            {"b": "make b alike"}))


def collectives_of_agreeing_install() -> int:
    """How many collectives ``agreement.agree`` launches when every rank agrees (its all-gather and any torch
    collective it could call besides, counted where it calls them)."""
    calls = []
    targets = [(agreement, "_all_gather_single")] + [(dist, n) for n in ("all_gather_object", "all_gather",
                                                                          "all_reduce", "broadcast", "barrier")]
    real = [(where, name, getattr(where, name)) for where, name in targets]

    def counting(name, fn):
        def call(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return call
    try:
        for where, name, fn in real:
            setattr(where, name, counting(name, fn))
        agreement.agree("probe", {"method": "topk", "parameters": "a (2,)\nb (3,)"}, None)
    finally:
        for where, name, fn in real:
            setattr(where, name, fn)
    return len(calls)


def install_dense_per_rank(rules: list) -> tuple:
    """Rank r installs topk with ``dense=rules[r]`` (None: no rule) and trains: the parameters' sum, or the error."""
    def call():
        model = ddp(mlp(0))
        gcomp.install(model, "topk", ratio=0.1, dense=rules[dist.get_rank()])
        train(model, 2)
        return float(flat_params(model).double().sum())
    return _outcome(call)
