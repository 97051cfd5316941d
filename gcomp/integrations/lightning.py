"""gcomp in Lightning: a callback that installs the hook on the strategy's DDP model, and one that runs DiLoCo.

    from gcomp.integrations.lightning import GcompCallback
    trainer = L.Trainer(strategy="ddp", devices=2, callbacks=[GcompCallback("topk", ratio=0.01)])
    # or DiLoCo (gcomp.outer): local steps, and every sync_every steps the outer gradient through the method
    diloco = DiLoCoCallback(sync_every=50, method="topk:ratio=0.05")
    trainer = L.Trainer(strategy="ddp", devices=2, callbacks=[diloco])

Why a callback and not a strategy: ``DDPStrategy(ddp_comm_hook=..., ddp_comm_state=...)`` registers the hook on
CUDA only (on CPU it skips it without a word), and it saves no hook state in checkpoints. A callback works
with whatever DDP strategy a user already configured, on every accelerator, and takes part in checkpoints.
Where ``DDPStrategy`` does register hooks, ``gcomp.comm_hook`` gives what it takes.
"""
from __future__ import annotations

import logging
from typing import Any

from torch.nn.parallel import DistributedDataParallel

from gcomp.hook import HookState, gcomp_hook
from gcomp.installer import NotDistributed, comm_hook
from gcomp.registry import method_from

try:
    from lightning.pytorch.callbacks import Callback
except ImportError as err:  # pragma: no cover - the message is the point
    raise ImportError("gcomp.integrations.lightning needs Lightning: pip install 'gcomp[lightning]'") from err

_log = logging.getLogger("gcomp")


class GcompCallback(Callback):
    """Install a gcomp method on the strategy's DDP model when fitting starts, on every accelerator.

    - ``callback.state`` is the ``HookState`` (None before ``fit``; on a run of one process, where there is no
      DDP model and nothing to compress, a ``NotDistributed`` state: ``stats`` all zero, "not distributed:
      nothing compressed");
    - checkpoints carry every rank's hook state (gathered to rank 0, which writes the file); resuming hands
      each rank its own part;
    - ``log_every_n_steps`` of the trainer: ``gcomp_ratio`` (bytes a dense all-reduce would send / bytes sent,
      so far) and ``gcomp_bytes_per_step`` (bytes this rank sent per step since the last log) through the
      LightningModule's ``log``.

    Parameters are validated when the callback is made.
    """

    def __init__(self, name_or_method, **params):
        self._method_args = (name_or_method, params)
        method_from(name_or_method, dict(params))  # a bad name or parameter fails here, before fitting
        self.state: HookState | None = None
        self._logged = (0, 0)  # (steps, bytes_sent) at the last log

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        name_or_method, params = self._method_args
        if trainer.world_size <= 1:
            self.state = NotDistributed(method_from(name_or_method, dict(params)), "one process: Lightning made no "
                                        "DistributedDataParallel")
            _log.info("gcomp: one process and no DistributedDataParallel model: nothing to compress, no hook")
            return
        # known by name through the LightningModule: the DDP model made later holds the same parameters
        self.state, _ = comm_hook(method_from(name_or_method, dict(params)), model=pl_module)

    def on_fit_start(self, trainer, pl_module) -> None:
        if not isinstance(self.state, HookState):
            return
        ddp = trainer.strategy.model
        if not isinstance(ddp, DistributedDataParallel):
            raise TypeError(f"GcompCallback needs a DDP strategy (strategy='ddp', DDPStrategy(...)); the trainer's "
                            f"model is a {type(ddp).__name__} under {type(trainer.strategy).__name__}")
        if getattr(ddp, "_gcomp_state", None) is not None:
            raise RuntimeError("a gcomp hook is already installed on this DDP model")
        if self.state.method.stateful:
            self.state.warmup = max(self.state.warmup, HookState._warmup_steps(ddp))
        ddp.register_comm_hook(self.state, gcomp_hook)
        ddp._gcomp_state = self.state

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.state is None or (trainer.global_step % max(trainer.log_every_n_steps, 1)):
            return
        stats = self.state.stats
        steps, sent = stats["steps"] - self._logged[0], stats["bytes_sent"] - self._logged[1]
        pl_module.log("gcomp_ratio", float(self.state.compression_ratio), on_step=True, on_epoch=False)
        if steps:
            pl_module.log("gcomp_bytes_per_step", float(sent / steps), on_step=True, on_epoch=False)
        self._logged = (stats["steps"], stats["bytes_sent"])

    def state_dict(self) -> dict[str, Any]:
        # every rank calls this when Lightning saves; rank 0 writes the file, so it receives every rank's part
        if not isinstance(self.state, HookState):
            return {}
        return {"gcomp": self.state.gather_state_dict(dst=0)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("gcomp")
        if saved is None:
            return
        if not isinstance(self.state, HookState):
            raise RuntimeError("GcompCallback: the checkpoint holds a gcomp hook state but this run installs no hook "
                               "(one process?)")
        self.state.load_state_dict(saved)


class DiLoCoCallback(Callback):
    """DiLoCo (``gcomp.outer.DiLoCo``) in Lightning: the strategy's DDP model keeps its steps local (or within
    ``inner_group``: ``gcomp.outer.keep_local``), and every ``sync_every`` optimizer steps the outer gradient is
    reduced through ``method``. ``callback.outer`` is the ``DiLoCo`` (None before ``fit``); checkpoints carry it
    (every rank's part gathered to rank 0). ``options`` go to ``DiLoCo`` (``outer_optimizer``, ``fragments``,
    ``overlap``, ``group``, ...); arguments are checked when the callback is made. On the wire: the outer
    loop's (``gcomp.outer.DiLoCo``: the method's collective every ``sync_every`` steps), and nothing per step
    beyond ``inner_group``'s all-reduce when one is given."""

    def __init__(self, sync_every: int = 50, method="identity", inner_group=None, **options):
        from gcomp.outer import arguments

        arguments.check(sync_every, options.get("fragments", 1), options.get("overlap", 0),
                        options.get("bucket_mb", 25), options.get("alpha", 1.0), options.get("check_every", 1))
        arguments.outer_method(method)
        self._args = dict(sync_every=sync_every, method=method, inner_group=inner_group, **options)
        self.outer = None
        self._saved = None  # a checkpoint's state, loaded once the outer state exists
        self._loaded = False  # whether a checkpoint gave the outer state its step count

    def on_fit_start(self, trainer, pl_module) -> None:
        from gcomp.outer import DiLoCo, keep_local

        ddp = trainer.strategy.model
        if isinstance(ddp, DistributedDataParallel):
            keep_local(ddp, self._args["inner_group"])
        self.outer = DiLoCo(pl_module, **self._args)
        if self._saved is not None:
            self.outer.load_state_dict(self._saved)
            self._saved, self._loaded = None, True

    def on_train_start(self, trainer, pl_module) -> None:
        # Lightning restores global_step after on_fit_start: a resume from a checkpoint that holds no outer state
        # starts the outer count there, rather than replaying the steps already taken
        if self.outer is not None and not self._loaded:
            self.outer.iteration = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # the outer state counts its own steps (and a checkpoint restores that count): one call per optimizer step
        while self.outer is not None and self.outer.iteration < trainer.global_step:
            self.outer.step()

    def state_dict(self) -> dict[str, Any]:
        return {} if self.outer is None else {"gcomp_outer": self.outer.gather_state_dict(dst=0)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("gcomp_outer")
        if saved is None:
            return
        if self.outer is None:
            self._saved = saved
        else:
            self.outer.load_state_dict(saved)
            self._loaded = True
