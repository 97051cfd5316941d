"""gcomp in Accelerate (docs/integrations.md): install on the model ``prepare`` returned (Accelerate's
``DistributedDataParallelKwargs(comm_hook=...)`` takes only PyTorch's own hooks), every rank's state in
``save_state``.

    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    state = gcomp_accelerate.install(accelerator, model, "topk", ratio=0.01)
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
    """``gcomp.install`` on a model ``accelerator.prepare`` returned, its state registered for checkpointing (in the
    same order when resuming); on one process a ``NotDistributed`` state."""
    alone = one_process_of_many(accelerator.num_processes)
    if alone is not None:
        method_from(name_or_method, dict(params))  # a bad name or parameter is named first
        raise ValueError(f"gcomp: {alone}")
    state = install_hook(model, name_or_method, if_distributed=True, **params)
    if not isinstance(state, NotDistributed):  # a hook state, or FSDP2's
        accelerator.register_for_checkpointing(GatheredHookState(state))
    return state


def diloco(accelerator, model, sync_every: int = 50, method="identity", inner_group=None, **options):
    """``gcomp.outer.DiLoCo`` on a model ``accelerator.prepare`` returned: its steps kept local (or within
    ``inner_group``), the outer state registered for checkpointing; ``options`` go to ``DiLoCo``."""
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
