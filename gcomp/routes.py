"""The advice for a model ``install`` cannot take: inside a trainer, the trainer's route, not "wrap it in DDP".

The trainers are looked for only where a script has already imported them (``sys.modules``): gcomp imports
none of them.
"""
from __future__ import annotations

import os
import sys

import torch


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
    """The error where Accelerate runs one process though a launcher started several (on CPU without
    ``Accelerator(cpu=True)``, every process trains alone), else None."""
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
