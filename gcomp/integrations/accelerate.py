"""gcomp in Accelerate: install on the prepared model, and every rank's hook state in ``save_state``.

    from gcomp.integrations import accelerate as gcomp_accelerate
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    state = gcomp_accelerate.install(accelerator, model, "topk", ratio=0.01)

Accelerate's ``DistributedDataParallelKwargs(comm_hook=...)`` takes only PyTorch's own hooks, so gcomp goes
on after ``prepare``, on the DDP model it returns. This helper also registers the hook state for
checkpointing: ``accelerator.save_state`` asks every process for it and the main process writes it, so the
file holds every rank's part (gathered); ``load_state`` hands each rank its own.

Two processes on CPU: ``Accelerator(cpu=True)`` in the script and ``accelerate launch --multi_gpu
--num_processes 2 --main_process_port 0 train.py`` (or torchrun). ``accelerate launch --cpu`` starts one
process whatever ``--num_processes`` says (it starts several only through MPI), and a plain ``Accelerator()``
on CPU runs every launched process alone: ``install`` refuses that, naming the fix. On one process
``prepare`` makes no DDP model: nothing is installed and a ``NotDistributed`` state is returned (``stats`` all
zero, "not distributed: nothing compressed").

DiLoCo (``gcomp.outer``): ``outer = gcomp_accelerate.diloco(accelerator, model, sync_every=50,
method="topk:ratio=0.05")`` after ``prepare``, and ``outer.step()`` after each ``optimizer.step()``.
"""
from __future__ import annotations

from typing import Any

from torch.nn.parallel import DistributedDataParallel

from gcomp.hook import HookState
from gcomp.installer import NotDistributed, install as install_hook, one_process_of_many
from gcomp.registry import method_from


class GatheredHookState:
    """A hook state as Accelerate checkpoints custom objects: ``state_dict`` gathers every rank's part to rank 0
    (called on every process by ``save_state``); ``load_state_dict`` takes this rank's own."""

    def __init__(self, state: HookState):
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return self.state.gather_state_dict(dst=0) or {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state.load_state_dict(state)


def install(accelerator, model, name_or_method, **params) -> HookState | NotDistributed:
    """``gcomp.install`` on a model ``accelerator.prepare`` returned, and the hook state registered with
    ``accelerator.register_for_checkpointing`` (register in the same order when resuming, as Accelerate
    requires). Returns the hook state, or on one process a ``NotDistributed`` state (nothing compressed)."""
    alone = one_process_of_many(accelerator.num_processes)
    if alone is not None:
        method_from(name_or_method, dict(params))  # a bad name or parameter is named first
        raise ValueError(f"gcomp: {alone}")
    state = install_hook(model, name_or_method, if_distributed=True, **params)
    if not isinstance(state, NotDistributed):  # a hook state, or FSDP2's
        accelerator.register_for_checkpointing(GatheredHookState(state))
    return state


def diloco(accelerator, model, sync_every: int = 50, method="identity", inner_group=None, **options):
    """``gcomp.outer.DiLoCo`` on a model ``accelerator.prepare`` returned: the DDP model's steps kept local (or
    within ``inner_group``: ``gcomp.outer.keep_local``), the outer state registered with
    ``accelerator.register_for_checkpointing`` (every rank's part gathered into ``save_state``'s file). Call
    ``outer.step()`` after each ``optimizer.step()``. ``options`` go to ``DiLoCo`` (``outer_optimizer``,
    ``fragments``, ``overlap``, ...)."""
    from gcomp.outer import DiLoCo, keep_local
    from gcomp.outer.arguments import outer_method

    alone = one_process_of_many(accelerator.num_processes)
    if alone is not None:
        outer_method(method)  # a bad spec is named first
        raise ValueError(f"gcomp: {alone}")
    outer = DiLoCo(model, sync_every=sync_every, method=method, inner_group=inner_group, **options)
    if isinstance(model, DistributedDataParallel):
        keep_local(model, inner_group)
    accelerator.register_for_checkpointing(GatheredHookState(outer))
    return outer
