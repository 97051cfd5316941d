"""``gcomp.outer.DiLoCo``'s arguments, checked before anything is built: a bad one is a ``ValueError`` naming it."""
from __future__ import annotations

import math
from typing import Callable, Union

import torch

from gcomp.method import MethodUnit
from gcomp.registry import from_spec


def default_outer_optimizer(params) -> torch.optim.Optimizer:
    """DiLoCo's outer optimizer: SGD, lr 0.7, momentum 0.9, Nesterov (Douillard et al., 2023)."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def outer_method(method: Union[str, MethodUnit]) -> MethodUnit:
    """A spec (``"topk:ratio=0.05"``) or a method unit; one that reads the model (pruning masks) is refused."""
    if isinstance(method, str):
        unit = from_spec(method)
    elif isinstance(method, MethodUnit):
        unit = method
    else:
        raise TypeError(f"gcomp.outer: method must be a spec ('topk:ratio=0.05') or a gcomp method unit; got "
                        f"{type(method).__name__}")
    if unit.reads_model:
        raise ValueError(f"gcomp.outer: {unit.name} reads the model it is bound to (pruning masks), so it cannot "
                         "reduce a flat outer gradient (the change of the parameters over sync_every steps); use a "
                         "method that reduces any flat tensor (gcomp.available(): identity, fp16, topk, powersgd, "
                         "...)")
    return unit


def check(sync_every: int, fragments: int, overlap: int, bucket_mb: float, alpha: float, check_every: int) -> None:
    """The numbers: ``sync_every >= 1``; ``fragments >= 1`` (at most the number of trained parameters, checked
    when they are known); ``0 <= overlap < sync_every / fragments`` (a fragment's reduction is applied before the
    next fragment's starts: one in flight); ``bucket_mb > 0``; ``0 < alpha <= 1``; ``check_every >= 0``."""
    for name, value in (("sync_every", sync_every), ("fragments", fragments), ("overlap", overlap),
                        ("check_every", check_every)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"gcomp.outer: {name} must be an int, got {value!r}")
    if sync_every < 1:
        raise ValueError(f"gcomp.outer: sync_every must be at least 1 (inner steps between outer syncs), got "
                         f"{sync_every}")
    if fragments < 1:
        raise ValueError(f"gcomp.outer: fragments must be at least 1, got {fragments}")
    if overlap < 0 or overlap * fragments >= sync_every:
        raise ValueError(f"gcomp.outer: overlap must satisfy 0 <= overlap < sync_every / fragments "
                         f"({sync_every} / {fragments}), so that one fragment at most is in flight; got {overlap}")
    if not (isinstance(bucket_mb, (int, float)) and math.isfinite(bucket_mb) and bucket_mb > 0):
        raise ValueError(f"gcomp.outer: bucket_mb must be a positive number, got {bucket_mb!r}")
    if not (isinstance(alpha, (int, float)) and 0 < alpha <= 1):
        raise ValueError(f"gcomp.outer: alpha (the global copy's weight in the merge) must be in (0, 1], got "
                         f"{alpha!r}")
    if check_every < 0:
        raise ValueError(f"gcomp.outer: check_every must be 0 (never) or more, got {check_every}")


def outer_optimizer_of(make: Callable | None, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The outer optimizer ``make`` builds over ``params`` (the default when None), checked to be one."""
    opt = (make or default_outer_optimizer)(params)
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"gcomp.outer: outer_optimizer must be a callable params -> torch.optim.Optimizer; it "
                        f"returned {type(opt).__name__}")
    return opt


def describe_optimizer(opt: torch.optim.Optimizer) -> str:
    """The outer optimizer as every rank must hold it: its class and each group's settings."""
    groups = [{k: v for k, v in sorted(g.items()) if k != "params"} for g in opt.param_groups]
    return f"{type(opt).__qualname__} {groups!r}"
