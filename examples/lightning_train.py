"""Lightning with gcomp: scikit-learn's bundled digits, a small MLP, two CPU processes, a method by name.

    python examples/lightning_train.py --dir /tmp/lit --method topk:ratio=0.05 --epochs 3
    python examples/lightning_train.py --dir /tmp/lit2 --epochs 3 --resume /tmp/lit/epoch=0.ckpt

The one gcomp line is the callback: ``callbacks=[GcompCallback(method, **params)]``. It installs the hook on
the strategy's DDP model on every accelerator (Lightning's own ``ddp_comm_hook`` is skipped on CPU), logs
``gcomp_ratio`` and ``gcomp_bytes_per_step``, and puts every rank's hook state in Lightning's checkpoints.

Rank 0 prints ``BYTES sent=S dense=D steps=N`` (its totals); ``--dir`` then holds one checkpoint per epoch
(``epoch=E.ckpt``), the CSV logs and ``final_rank{R}.pt``, each rank's parameters.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gcomp

from gcomp.integrations.lightning import GcompCallback


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="checkpoints, logs and each rank's final parameters go here")
    p.add_argument("--method", default="topk:ratio=0.05", type=gcomp.registry.spec_argument,
                   help="a method and its parameters, as gcomp bench takes them (default topk:ratio=0.05)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--resume", default=None, help="a checkpoint to resume from")
    args = p.parse_args(argv)
    return args


class Digits(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss, on_step=True, on_epoch=False)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def data() -> DataLoader:
    x, y = load_digits(return_X_y=True)
    dataset = TensorDataset(torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y))
    return DataLoader(dataset, batch_size=64, shuffle=True)  # Lightning swaps in a DistributedSampler


def main(argv=None) -> None:
    args = parse_args(argv)
    folder = Path(args.dir)
    name, params = args.method
    gcomp_callback = GcompCallback(name, **params)
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy="ddp", max_epochs=args.epochs,
                        callbacks=[gcomp_callback, ModelCheckpoint(dirpath=folder, filename="{epoch}",
                                                                   save_top_k=-1, every_n_epochs=1)],
                        logger=CSVLogger(folder, name="logs"), log_every_n_steps=5, deterministic=True,
                        enable_progress_bar=False, enable_model_summary=False)
    model = Digits()
    trainer.fit(model, data(), ckpt_path=args.resume)
    # every rank writes its own parameters: the replicas are compared from the files (a last collective right
    # before exit can abort the process in gloo's thread at interpreter shutdown, with or without gcomp)
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()},
               folder / f"final_rank{trainer.global_rank}.pt")
    if trainer.global_rank == 0 and gcomp_callback.state is not None:
        stats = gcomp_callback.state.stats
        print(f"BYTES sent={stats['bytes_sent']} dense={stats['bytes_dense']} steps={stats['steps']}", flush=True)

if __name__ == "__main__":
    main()
