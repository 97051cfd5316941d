"""Survive a killed worker: checkpoint every K steps (model, optimizer and every rank's gcomp state), let torchrun
restart the group, resume from the last checkpoint.

    torchrun --standalone --nproc_per_node 2 --max-restarts 1 examples/elastic.py --dir /tmp/elastic
    # to see a restart: --kill-at 7 makes rank 1 SIGKILL itself at step 7 of the first attempt

What it shows, in order:

- **Rendezvous per attempt.** After a restart, ``init_process_group`` on torchrun's address fails on these
  machines with gloo's "connectFullMesh: connection refused", with or without gcomp: the store still holds the
  keys of the attempt that died. Each attempt therefore builds its process group on its own key space of the
  store, ``PrefixStore(f"attempt{TORCHELASTIC_RESTART_COUNT}", store)``: ``gcomp.elastic.init_process_group``.
- **Every rank's gcomp state in one file.** ``state.gather_state_dict(dst=0)`` collects each rank's own
  residuals; rank 0 writes them with the model and the optimizer (the same on every rank: DDP keeps the
  replicas identical), atomically. On start every rank loads the newest checkpoint, and ``load_state_dict``
  hands each rank its own part.
- **The same trajectory.** Batches depend only on the step and the rank, so the resumed run repeats the steps
  after the checkpoint exactly: with ``topk`` its final parameters equal those of a run never killed
  (``tests/test_example_elastic.py`` checks it, bit for bit).

Rank 0 prints ``RESUMED step=S attempt=A at=T`` (T: seconds since the epoch, when training resumed) and, at the
end, ``DONE steps=N``; a killed rank 1 prints ``KILLED step=S at=T`` first; ``--dir`` then holds ``final.pt`` (rank 0's parameters) and ``checkpoint.pt``.
"""
from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gcomp
import gcomp.elastic


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="where the checkpoint and the final parameters go")
    p.add_argument("--method", default="topk:ratio=0.05", type=gcomp.registry.spec_argument,
                   help="a method and its parameters, as gcomp bench takes them (default topk:ratio=0.05)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--checkpoint-every", type=int, default=5, dest="every")
    p.add_argument("--kill-at", type=int, default=None, dest="kill_at",
                   help="rank 1 SIGKILLs itself at this step of the first attempt (to see a restart)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.every < 1:
        p.error("--steps and --checkpoint-every take whole numbers of at least 1")
    return args


def model_and_batches(rank: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 10))

    def batch(step: int):
        g = torch.Generator().manual_seed(1000 * step + rank)  # the step and the rank decide, nothing else
        return torch.randn(16, 20, generator=g), torch.randint(0, 10, (16,), generator=g)

    return model, batch


def save(path: Path, step: int, ddp, optimizer, state) -> None:
    """Every rank's gcomp state to rank 0, written there with the model and the optimizer, atomically."""
    gathered = state.gather_state_dict(dst=0)
    if dist.get_rank() == 0:
        tmp = path.with_suffix(".tmp")
        torch.save({"step": step, "model": ddp.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "gcomp": gathered}, tmp)
        os.replace(tmp, path)
    dist.barrier()  # nobody goes on (and might be killed) before the checkpoint is whole


def main(argv=None) -> int:
    args = parse_args(argv)
    attempt = gcomp.elastic.init_process_group("gloo")
    rank = dist.get_rank()
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "checkpoint.pt"
    net, batch = model_and_batches(rank)
    start = 0
    saved = torch.load(path, weights_only=True) if path.exists() else None
    if saved is not None:
        net.load_state_dict(saved["model"])
        start = saved["step"]
    ddp = DistributedDataParallel(net)
    name, params = args.method
    state = gcomp.install(ddp, name, **params)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    if saved is not None:
        state.load_state_dict(saved["gcomp"])  # this rank's own residuals
        optimizer.load_state_dict(saved["optimizer"])
    if rank == 0:
        print(f"RESUMED step={start} attempt={attempt} at={time.time():.3f}", flush=True)
    for step in range(start, args.steps):
        if args.kill_at == step and attempt == 0 and rank == 1:
            print(f"KILLED step={step} at={time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch(step)
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
        if (step + 1) % args.every == 0 and step + 1 < args.steps:
            save(path, step + 1, ddp, optimizer, state)
    if rank == 0:
        torch.save({n: p.detach().clone() for n, p in ddp.module.named_parameters()}, folder / "final.pt")
        print(f"DONE steps={args.steps}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
