"""gcomp in the Hugging Face Trainer: one callback.

    from gcomp.integrations.transformers import GcompCallback
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[GcompCallback("topk", ratio=0.01)])

The Trainer builds its DDP model inside ``train`` and shows callbacks only the model inside it, so the callback
finds the DDP model at the first forward: a forward pre-hook on the model reads
``DistributedDataParallel._get_active_ddp_module()`` (the DDP model running it) and installs gcomp there, before
the first backward. Every rank's hook state goes into the Trainer's checkpoints as ``gcomp-rank{R}.pt`` (each
rank writes its own, as the Trainer writes ``rng_state_{R}.pth``) and a resumed ``train`` loads it.
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

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
    """Install a gcomp method on the Trainer's DDP model, log its ratio, keep its state in checkpoints.

    - ``callback.state``: the ``HookState`` once training runs (None before; on one process a
      ``NotDistributed`` state: nothing to compress);
    - every log gets ``gcomp_ratio`` (bytes a dense all-reduce would send / bytes sent, so far, this rank), in
      ``trainer.state.log_history`` and in the logs of the callbacks after this one (reporters the Trainer
      made from ``report_to`` come before user callbacks, so they do not see it);
    - each checkpoint folder gets ``gcomp-rank{R}.pt`` from every rank; when ``train`` resumes (global step
      above 0) every rank loads its own from the folder ``train(resume_from_checkpoint=...)`` resumes from
      (else ``output_dir/checkpoint-{step}``), or from ``resume`` where it names a folder. A resumed run
      whose folder holds no gcomp state is a ValueError on every rank; ``resume=False`` starts gcomp's state
      afresh instead. One process refuses a folder holding a distributed run's gcomp state the same way.

    Parameters are validated when the callback is made.
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
    """The folder ``Trainer.train(resume_from_checkpoint=...)`` resumes from, as its training loop holds it
    (True already resolved to the last checkpoint). Callbacks are not told it; the loop that calls them has it
    as a parameter (transformers 4.x and 5.x), read here from the call stack."""
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
    found = torch.tensor([1 if path.is_file() else 0])
    if dist.get_backend(group) == "nccl":  # NCCL reduces CUDA tensors only
        found = found.cuda()
    dist.all_reduce(found, op=dist.ReduceOp.MIN, group=group)
    if not found.item():
        raise ValueError(f"gcomp: resuming from {folder}, which holds no gcomp state for every rank "
                         f"({path.name} and its siblings): it was saved without GcompCallback, or elsewhere. Pass "
                         "GcompCallback(..., resume='<folder with gcomp-rank*.pt>'), or resume=False to start "
                         "gcomp's state afresh")
    return torch.load(path, weights_only=True)
