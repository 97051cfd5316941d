"""gcomp in Accelerate: install on the prepared model, and every rank's hook state in ``save_state``.

    from gcomp.integrations import accelerate as gcomp_accelerate
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    state = gcomp_accelerate.install(accelerator, model, "topk", ratio=0.01)

Accelerate's ``DistributedDataParallelKwargs(comm_hook=...)`` takes only PyTorch's own hooks, so gcomp goes
on after ``prepare``, on the DDP model it returns. This helper also registers the hook state for
checkpointing: ``accelerator.save_state`` asks every process for it and the main process writes it, so the
file holds every rank's part (gathered); ``load_state`` hands each rank its own. On one process (``accelerate
launch --cpu`` starts one) ``prepare`` makes no DDP model: nothing is installed, one info line says so, and
None is returned.
"""
from __future__ import annotations

from typing import Any

from gcomp.hook import HookState
from gcomp.attach import install as install_hook


class GatheredHookState:
    """A hook state as Accelerate checkpoints custom objects: ``state_dict`` gathers every rank's part to rank 0
    (called on every process by ``save_state``); ``load_state_dict`` takes this rank's own."""

    def __init__(self, state: HookState):
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return self.state.gather_state_dict(dst=0) or {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state.load_state_dict(state)


def install(accelerator, model, name_or_method, **params) -> HookState | None:
    """``gcomp.install`` on a model ``accelerator.prepare`` returned, and the hook state registered with
    ``accelerator.register_for_checkpointing`` (register in the same order when resuming, as Accelerate
    requires). Returns the hook state, or None on one process."""
    state = install_hook(model, name_or_method, if_distributed=True, **params)
    if state is not None:
        accelerator.register_for_checkpointing(GatheredHookState(state))
    return state
