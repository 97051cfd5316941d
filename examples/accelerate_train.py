"""Accelerate with gcomp: scikit-learn's bundled digits, a small MLP, a method by name.

    accelerate launch --multi_gpu --num_processes 2 --main_process_port 0 examples/accelerate_train.py --dir /tmp/acc
    accelerate launch --multi_gpu --num_processes 2 --main_process_port 0 examples/accelerate_train.py \
        --dir /tmp/acc2 --resume /tmp/acc/state

On CPU, ``--multi_gpu`` is Accelerate's route to several processes (it runs torchrun; ``torchrun
--nproc_per_node 2 examples/accelerate_train.py ...`` does the same) and ``Accelerator(cpu=True)`` makes them
one gloo group; ``accelerate launch --cpu`` starts one process whatever ``--num_processes`` says.

The gcomp line comes after ``accelerator.prepare``:
``gcomp.integrations.accelerate.install(accelerator, model, method, **params)`` installs the hook on the DDP
model ``prepare`` made and registers the hook state, so ``accelerator.save_state`` holds every rank's part and
``load_state`` gives each rank its own. Under one process (``python examples/accelerate_train.py``) there is no
DDP model: it installs nothing and the state it returns says so (``stats`` all zero).

Batches depend only on the step and the rank, so a resumed run repeats the uninterrupted one exactly. Rank 0
prints ``BYTES sent=S dense=D steps=N``; ``--dir`` holds ``state/`` (saved at ``--save-at``) and
``final_rank{R}.pt``, each rank's parameters.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from sklearn.datasets import load_digits
from torch import nn

import gcomp
from gcomp.integrations import accelerate as gcomp_accelerate


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True)
    p.add_argument("--method", default="topk:ratio=0.05", type=gcomp.registry.spec_argument,
                   help="a method and its parameters, as gcomp bench takes them (default topk:ratio=0.05)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--save-at", type=int, default=10, dest="save_at")
    p.add_argument("--resume", default=None, help="a folder accelerator.save_state wrote")
    args = p.parse_args(argv)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    accelerator = Accelerator(cpu=True)
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    name, params = args.method
    state = gcomp_accelerate.install(accelerator, model, name, **params)
    start = 0
    if args.resume:
        accelerator.load_state(args.resume)
        start = args.save_at
    rank = accelerator.process_index
    for step in range(start, args.steps):
        pick = torch.randint(0, len(x), (64,), generator=torch.Generator().manual_seed(1000 * step + rank))
        optimizer.zero_grad()
        accelerator.backward(nn.functional.cross_entropy(model(x[pick]), y[pick]))
        optimizer.step()
        if step + 1 == args.save_at and not args.resume:
            accelerator.save_state(folder / "state")
    # every rank writes its own parameters: the replicas are compared from the files (a last collective right
    # before exit can abort the process in gloo's thread at interpreter shutdown, with or without gcomp)
    torch.save({n: p.detach().clone() for n, p in accelerator.unwrap_model(model).named_parameters()},
               folder / f"final_rank{accelerator.process_index}.pt")
    if accelerator.is_main_process:
        print(f"BYTES sent={state.stats['bytes_sent']} dense={state.stats['bytes_dense']} "
              f"steps={state.stats['steps']}", flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
    # Everything the run owes is written. Leave without the interpreter's shutdown: a gloo worker thread that
    # still drops a finished collective's tensors then needs the GIL, and aborts the process ("terminate called
    # without an active exception", a hazard of gloo under PyTorch's own shutdown, with or without gcomp).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
