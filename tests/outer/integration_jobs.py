"""Rank jobs of tests/outer/test_integrations.py: DiLoCo through Lightning's Trainer and Accelerate's helper."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tests import models


def _lightning_module():
    import lightning as L

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = models.mlp(0)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Tiny()


def job_lightning(steps: int, sync_every: int) -> dict:
    """A Lightning Trainer (strategy ddp on the ranks' own process group) with DiLoCoCallback(topk)."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from gcomp.integrations.lightning import DiLoCoCallback

    rank, world = dist.get_rank(), dist.get_world_size()
    env = {"LOCAL_RANK": str(rank), "RANK": str(rank), "WORLD_SIZE": str(world), "NODE_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}  # the group exists: Lightning joins it, opens none
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        x, y = models.batch(0, rank, size=8 * steps)
        data = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False)
        callback = DiLoCoCallback(sync_every=sync_every, method="topk:ratio=0.3")
        module = _lightning_module()
        trainer = L.Trainer(accelerator="cpu", devices=world, strategy="ddp", max_steps=steps, callbacks=[callback],
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, use_distributed_sampler=False)
        trainer.fit(module, data)
        saved = callback.state_dict()["gcomp_outer"]  # a collective: every rank's part, to rank 0
        return {"params": models.flat_params(module.net).clone(), "stats": dict(callback.outer.stats),
                "saved": sorted(saved["ranks"]) if saved else None}
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class FakeAccelerator:
    """What gcomp's Accelerate helper asks of an Accelerator."""

    def __init__(self):
        self.num_processes = dist.get_world_size()
        self.registered = []

    def register_for_checkpointing(self, obj) -> None:
        self.registered.append(obj)


def job_accelerate(steps: int) -> dict:
    from gcomp.integrations import accelerate as gcomp_accelerate

    rank = dist.get_rank()
    model = models.ddp(models.mlp(0))
    accelerator = FakeAccelerator()
    outer = gcomp_accelerate.diloco(accelerator, model, sync_every=3, method="topk:ratio=0.3")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    after_one = None
    for step in range(steps):
        x, y = models.batch(step, rank)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        outer.step()
        if step == 0:
            after_one = models.flat_params(model.module).clone()
    saved = accelerator.registered[0].state_dict()
    return {"after_one": after_one, "params": models.flat_params(model.module).clone(), "stats": dict(outer.stats),
            "saved": sorted(saved["ranks"]) if saved else None}
