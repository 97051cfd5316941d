"""gcomp in the Hugging Face Trainer: one callback (docs/integrations.md). The Trainer builds its DDP model inside
``train`` and shows callbacks only the model inside it, so a forward pre-hook finds the DDP model running it
(``DistributedDataParallel._get_active_ddp_module()``) and installs gcomp there, before the first backward.

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[GcompCallback("topk", ratio=0.01)])
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gcomp.agreement import collective_device
from gcomp.hook import HookState
from gcomp.installer import NotDistributed, install as install_hook
from gcomp.registry import method_from

try:
    from transformers import TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as err:  # pragma: no cover - the message is the point
    raise ImportError("gcomp.integrations.transformers needs transformers: pip install 'gcomp[transformers]'") from err

_log = logging.getLogger("gcomp")


def state_file(folder, rank: int) -> Path:
    """Where a checkpoint folder holds rank ``rank``'s gcomp state."""
    return Path(folder) / f"gcomp-rank{rank}.pt"


class GcompCallback(TrainerCallback):
    """Install a gcomp method on the Trainer's DDP model, log ``gcomp_ratio``, keep every rank's state in the
    checkpoint folders (``gcomp-rank{R}.pt``); a resumed ``train`` loads it from the folder it resumes from
    (``output_dir/checkpoint-{step}`` without one; ``resume``: another folder, or False to start afresh).
    ``callback.state``: the ``HookState`` once training runs (None before; a ``NotDistributed`` on one process).
    """

    def __init__(self, name_or_method, resume: bool | str | os.PathLike = True, **params):
        self._method_args = (name_or_method, params)
        self._method = method_from(name_or_method, dict(params))  # a bad name or parameter fails here
        self.resume = resume
        self.state: HookState | NotDistributed | None = None
        self._pending = None  # the forward pre-hook until it has installed

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.state is not None or self._pending is not None:
            return
        folder = self._resume_folder(args, state.global_step)
        if args.world_size <= 1:
            saved = sorted(folder.glob("gcomp-rank*.pt")) if folder is not None and folder.is_dir() else []
            if saved:
                raise ValueError(f"gcomp: {folder} holds a distributed run's gcomp state ({len(saved)} rank(s)) but "
                                 "this run is one process, where nothing is compressed: resume with as many "
                                 "processes as saved it, or pass GcompCallback(..., resume=False) to leave it")
            self.state = NotDistributed(self._method, "one process: the Trainer made no DistributedDataParallel")
            _log.info("gcomp: one process and no DistributedDataParallel model: nothing to compress, no hook")
            return
        self._pending = model.register_forward_pre_hook(lambda module, _: self._install(module, folder))

    def _resume_folder(self, args, step: int) -> Path | None:
        if self.resume is False or (step == 0 and self.resume is True):
            return None
        if self.resume is not True:
            return Path(self.resume)
        return Path(_trainer_resume_path() or Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{step}")

    def _install(self, module: torch.nn.Module, folder: Path | None) -> None:
        ddp = DistributedDataParallel._get_active_ddp_module()
        if ddp is None and not module.training:
            return  # an evaluation before training (eval_on_start) runs the bare model: wait for training's
        self._pending.remove()
        self._pending = None
        if not isinstance(ddp, DistributedDataParallel):
            raise TypeError("gcomp.integrations.transformers.GcompCallback needs the Trainer's DDP model (several "
                            "processes, no DeepSpeed or FSDP): the model's first forward ran outside DDP")
        name_or_method, params = self._method_args
        state = install_hook(ddp, name_or_method, **params)
        if folder is not None:
            state.load_state_dict(_load(folder, ddp.process_group))
        self.state = state

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.state is None or logs is None:
            return
        logs["gcomp_ratio"] = float(self.state.compression_ratio)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1]["gcomp_ratio"] = logs["gcomp_ratio"]

    def on_save(self, args, state, control, **kwargs):
        if isinstance(self.state, HookState):
            folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
            folder.mkdir(parents=True, exist_ok=True)
            torch.save(self.state.state_dict(), state_file(folder, dist.get_rank()))


def _trainer_resume_path() -> str | None:
    """The folder ``Trainer.train(resume_from_checkpoint=...)`` resumes from: callbacks are not told it, so it is
    read from the call stack, where the training loop (transformers 4.x and 5.x) holds it, resolved."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_inner_training_loop" and "resume_from_checkpoint" in frame.f_locals:
            found = frame.f_locals["resume_from_checkpoint"]
            return found if isinstance(found, (str, os.PathLike)) else None
        frame = frame.f_back
    return None


def _load(folder: Path, group) -> dict:
    """This rank's saved state; a folder without it on any rank is a ValueError on every rank."""
    path = state_file(folder, dist.get_rank())
    found = torch.tensor([1 if path.is_file() else 0], device=collective_device(group))
    dist.all_reduce(found, op=dist.ReduceOp.MIN, group=group)
    if not found.item():
        raise ValueError(f"gcomp: resuming from {folder}, which holds no gcomp state for every rank "
                         f"({path.name} and its siblings): it was saved without GcompCallback, or elsewhere. Pass "
                         "GcompCallback(..., resume='<folder with gcomp-rank*.pt>'), or resume=False to start "
                         "gcomp's state afresh")
    return torch.load(path, weights_only=True)
