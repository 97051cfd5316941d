"""gcomp in Lightning (docs/integrations.md): ``GcompCallback`` installs the hook on the strategy's DDP model (a
callback, since ``DDPStrategy`` registers hooks on CUDA only and saves no hook state), ``DiLoCoCallback`` runs
DiLoCo.

    trainer = L.Trainer(strategy="ddp", devices=2, callbacks=[GcompCallback("topk", ratio=0.01)])
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
    """Install a gcomp method on the strategy's DDP model when fitting starts, log its ratio, keep its state in
    checkpoints; ``callback.state`` is the ``HookState`` (None before ``fit``; a ``NotDistributed`` on one process).
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
    """``gcomp.outer.DiLoCo`` in Lightning: the strategy's DDP model keeps its steps local (or within
    ``inner_group``), ``callback.outer`` (None before ``fit``) syncs every ``sync_every`` optimizer steps and
    checkpoints gathered to rank 0; ``options`` go to ``DiLoCo``. On the wire: the outer loop's, and per step
    only ``inner_group``'s all-reduce."""

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
