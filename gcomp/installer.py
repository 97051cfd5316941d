"""Putting a method on a model: ``gcomp.comm_hook`` (the DDP hook, for trainers that register it themselves) and
``gcomp.install`` (a DDP or ``fully_shard``-ed model); a model it cannot take gets the advice that fits (a
trainer's route where a script imported one: gcomp imports none)."""
from __future__ import annotations

import logging
import os
import sys
from typing import Any, Callable, Union

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from gcomp.dense import DenseRule, DenseSpec
from gcomp.agreement import check_member, check_same_ranks
from gcomp.hook import HookState, gcomp_hook
from gcomp.method import MethodUnit
from gcomp.registry import method_from
from gcomp.run_state import STAT_KEYS, method_spec

_log = logging.getLogger("gcomp")


def comm_hook(name_or_method: Union[str, MethodUnit], process_group: dist.ProcessGroup | None = None,
              model: torch.nn.Module | None = None, *, dense: DenseSpec = None, dense_below: int | None = None,
              **params) -> tuple[HookState, Callable]:
    """``(state, hook)`` for ``ddp_model.register_comm_hook(state, hook)`` or a trainer that registers the hook
    (Lightning: ``DDPStrategy(ddp_comm_state=state, ddp_comm_hook=hook)``); one state serves one DDP model.

    Needs no process group yet: the state joins ``process_group`` (default: the default group; it must be the DDP
    model's) at its first bucket. ``model`` (or ``state.bind(model)``): see ``HookState``. ``dense`` (names or glob
    patterns, or a predicate ``(name, param) -> bool``) and ``dense_below=N`` (parameters of fewer than N entries)
    keep parameters uncompressed (``gcomp.dense``); they need ``model``.
    """
    rule = DenseRule.of(dense, dense_below)
    method = method_from(name_or_method, params)
    if dist.is_initialized():
        check_member(process_group, "gcomp.comm_hook")
    return HookState(method, model, process_group, rule), gcomp_hook


def install(model: torch.nn.Module | None = None, name_or_method: Union[str, MethodUnit, None] = None,
            process_group: dist.ProcessGroup | None = None, *, if_distributed: bool = False,
            dense: DenseSpec = None, dense_below: int | None = None, **params) -> HookState | NotDistributed:
    """Put a method on ``model`` and return its state: gcomp's hook on a DDP model (a ``HookState``; a
    ``torch.compile``d one is unwrapped), gcomp's reduce-scatter on every FSDP module of a ``fully_shard``-ed root
    (an ``FSDPState``: methods that cannot serve FSDP2 are refused).

    ``name_or_method``: a registered name (``params`` go to ``gcomp.create``) or a method built by hand;
    collectives run on ``process_group``, by default the DDP model's. ``if_distributed=True``: a model that is not
    DDP, on one process, is left as it is (one info line, logger ``gcomp``) and a ``NotDistributed`` returned;
    otherwise such a model is a ``TypeError`` naming the route. ``dense=`` / ``dense_below=``: as ``comm_hook``
    (DDP only).
    """
    if model is None or name_or_method is None:
        raise TypeError("gcomp.install takes a model and a method: install(model, 'topk', ratio=0.01)")
    ddp_model = model
    inner = getattr(ddp_model, "_orig_mod", None)  # torch.compile's OptimizedModule wraps the DDP model
    if isinstance(inner, (DistributedDataParallel, FSDPModule)):
        ddp_model = inner  # the hook lives on DDP's reducer, which the compiled module runs as it is
    rule = DenseRule.of(dense, dense_below)  # a bad rule is an error on one process too
    if isinstance(ddp_model, FSDPModule):
        if rule is not None:
            raise ValueError("gcomp.install: dense= / dense_below= is for DDP; not yet under FSDP2 (every "
                             "parameter of an FSDP2 model is compressed): leave it out")
        from gcomp.fsdp.install import install_fsdp  # FSDP2's own modules load only when used
        return install_fsdp(ddp_model, method_from(name_or_method, params), process_group)
    if not isinstance(ddp_model, DistributedDataParallel):
        return _not_ddp(ddp_model, name_or_method, params, if_distributed)
    if getattr(ddp_model, "_gcomp_state", None) is not None:
        raise RuntimeError(f"a gcomp hook ({ddp_model._gcomp_state.method.name}) is already installed on this "
                           "model; DDP takes one communication hook per model: build a new DDP model to change it")
    if process_group is None:
        process_group = ddp_model.process_group
    else:
        check_same_ranks("gcomp.install", process_group, ddp_model.process_group)
    state, hook = comm_hook(name_or_method, process_group, model=ddp_model, dense=dense, dense_below=dense_below,
                            **params)
    try:
        ddp_model.register_comm_hook(state, hook)
    except RuntimeError as err:
        raise RuntimeError("this DDP model already has a communication hook (DDP takes one per model, and its "
                           f"mixed_precision option registers its own): {err}") from err
    ddp_model._gcomp_state = state
    return state


def _not_ddp(model, name_or_method, params: dict, if_distributed: bool) -> NotDistributed:
    """``install`` on a model that is not DDP: a ``NotDistributed`` state where asked and alone, else the error."""
    alone = (not dist.is_initialized() or dist.get_world_size() == 1) and launched_processes() == 1
    route = trainer_route(model) if isinstance(model, torch.nn.Module) else None
    if if_distributed and alone and isinstance(model, torch.nn.Module):
        method = method_from(name_or_method, params)  # a bad name or parameter is an error on one process too
        _log.info("gcomp.install: one process and no DistributedDataParallel model (%s): nothing to "
                  "compress, no hook installed", type(model).__name__)
        return NotDistributed(method, f"one process, {type(model).__name__} is not DistributedDataParallel")
    launched = launched_processes()
    fix = route or ("Wrap it first: DistributedDataParallel(model)"
                    + ("" if if_distributed or not alone else
                       "; on one process, install(..., if_distributed=True) skips it instead")
                    + (f" ({launched} processes were launched, WORLD_SIZE={launched}, and no process group is "
                       "set up: torch.distributed.init_process_group first)"
                       if launched > 1 and not dist.is_initialized() else ""))
    raise TypeError(f"gcomp.install needs a torch.nn.parallel.DistributedDataParallel model; got "
                    f"{type(model).__name__}. {fix[0].upper()}{fix[1:]}")


class NotDistributed:
    """The state of a method installed where there is nothing to compress (one process, no DDP model): ``stats``
    all zero, ``compression_ratio`` 1.0, an empty ``state_dict()``; ``load_state_dict`` takes only an empty one (a
    distributed run's checkpoint holds every rank's part, which one process cannot continue).
    """

    distributed = False

    def __init__(self, method: MethodUnit, why: str):
        self.method = method
        self.why = why
        self.stats: dict[str, Any] = {key: 0 for key in STAT_KEYS}

    @property
    def compression_ratio(self) -> float:
        return 1.0

    def describe(self) -> str:
        return f"gcomp: not distributed: nothing compressed ({self.method.name}; {self.why})"

    __str__ = describe

    def __repr__(self) -> str:
        return f"NotDistributed({method_spec(self.method)}, {self.why!r})"

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError("gcomp: this run is not distributed (nothing compressed) but the checkpoint holds a "
                             "distributed run's gcomp state: resume it with as many processes as saved it")


# --- advice for a model install cannot take --------------------------------------------------------------------

def accelerate_processes() -> int | None:
    """Accelerate's process count where an ``Accelerator`` (its ``PartialState``) is set up, else None."""
    state = sys.modules.get("accelerate.state")
    shared = getattr(getattr(state, "PartialState", None), "_shared_state", None)
    return shared.get("num_processes", 1) if shared else None


def launched_processes() -> int:
    """The processes a launcher started (torchrun, ``accelerate launch``): its ``WORLD_SIZE``, else 1."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def one_process_of_many(processes: int | None) -> str | None:
    """The error where Accelerate runs one process though a launcher started several, else None."""
    launched = launched_processes()
    if processes is None or processes > 1 or launched <= 1:
        return None
    return (f"Accelerate runs this process alone though {launched} were launched (WORLD_SIZE={launched}): each "
            "would train its own model. On CPU, Accelerate is distributed only with Accelerator(cpu=True), "
            "launched by `accelerate launch --multi_gpu --num_processes N` or torchrun")


def trainer_route(model: torch.nn.Module) -> str | None:
    """What to do instead of wrapping ``model`` in DDP by hand, where a trainer owns the model; else None."""
    for package in ("lightning.pytorch", "pytorch_lightning"):
        lightning_module = getattr(sys.modules.get(package), "LightningModule", None)
        if lightning_module is not None and isinstance(model, lightning_module):
            return ("this is a LightningModule: Lightning builds the DDP model when fitting starts; pass "
                    "callbacks=[gcomp.integrations.lightning.GcompCallback('topk', ratio=0.01)] to L.Trainer "
                    "(with strategy='ddp') instead of calling gcomp.install")
    processes = accelerate_processes()
    if processes is not None:
        return (one_process_of_many(processes) or
                "under Accelerate: call accelerator.prepare(model) first, then "
                "gcomp.integrations.accelerate.install(accelerator, model, ...) on the model it returns")
    return None
