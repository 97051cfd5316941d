"""Train a small MLP on scikit-learn's bundled digits with DDP and a gcomp method; compare methods.

Two ways to start it (CPU, gloo):

    python examples/train.py --nproc 2 --compressor identity,fp16,topk --param topk.ratio=0.01
    torchrun --standalone --nproc_per_node 2 examples/train.py --compressor topk --param ratio=0.05

With ``--nproc N`` the script spawns N workers itself on 127.0.0.1 (a free port); under torchrun it reads
the rank and world size from the environment. Without either it runs one worker.

``--compressor`` may be repeated or given as a comma list: the methods run one after another under the
same seed and data, and rank 0 prints a comparison table at the end. ``--param key=value`` (repeatable)
sets a method parameter; values are read as bool (true/false), int, float or string. A plain ``key=value``
goes to every compared method that has a parameter called ``key`` (and is an error if none has);
``NAME.key=value`` goes to method NAME only. ``gcomp describe NAME`` lists a method's parameters.

The table's numbers are rank 0's ``state.stats``: bytes/step is ``bytes_sent / steps``, ratio is
``bytes_dense / bytes_sent`` (stateful methods such as topk send their first step dense, and that step is
counted), encode/decode are the seconds spent compressing and decoding, and step ms is rank 0's mean wall time
of forward, backward (with the hook's communication) and optimizer step.
"""
from __future__ import annotations

import argparse
import os
import socket
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from sklearn.datasets import load_digits
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gcomp


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compressor", action="append", default=None, metavar="NAME[,NAME...]",
                   help=f"method(s) to compare (default: identity); registered: {', '.join(gcomp.available())}")
    p.add_argument("--param", action="append", default=[], metavar="[NAME.]KEY=VALUE",
                   help="method parameter, e.g. ratio=0.01 or topk.ratio=0.01 (repeatable)")
    p.add_argument("--nproc", type=int, default=None, help="spawn this many CPU workers (not with torchrun)")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--steps", type=int, default=0, help="stop each method after this many steps (0: no limit)")
    p.add_argument("--batch", type=int, default=32, help="batch size per worker")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", default="128,64", metavar="W1,W2,...",
                   help="hidden layer widths of the MLP (default 128,64; wider layers send more per step)")
    args = p.parse_args(argv)
    try:
        args.hidden = [int(w) for w in args.hidden.split(",") if w.strip()]
    except ValueError:
        p.error(f"--hidden takes comma-separated integers; got {args.hidden!r}")
    if not args.hidden or min(args.hidden) < 1:
        p.error(f"--hidden needs at least one width, each at least 1; got {args.hidden}")
    args.methods = [n.strip() for item in args.compressor or ["identity"] for n in item.split(",") if n.strip()]
    try:
        args.method_params = {name: method_params(name, args.param, args.methods) for name in args.methods}
        for name in args.methods:
            gcomp.create(name, **args.method_params[name])  # fail here, before any worker starts
    except ValueError as err:
        p.error(str(err))
    if under_torchrun() and args.nproc is not None:
        p.error("--nproc spawns workers itself; under torchrun use --nproc_per_node instead")
    for flag, value, low in (("--nproc", 1 if args.nproc is None else args.nproc, 1), ("--epochs", args.epochs, 1),
                             ("--batch", args.batch, 1), ("--steps", args.steps, 0)):
        if value < low:
            p.error(f"{flag} must be at least {low}; got {value}")
    return args


def parse_value(text: str, spec) -> bool | int | float | str:
    if spec is not None and spec.type is str:
        return text
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def method_params(name: str, items: list[str], methods: list[str]) -> dict:
    """The ``--param`` values that apply to method ``name``."""
    accepted = gcomp.spec(name).params
    out = {}
    for item in items:
        key, sep, text = item.partition("=")
        target, _, key = key.rpartition(".")
        if not sep or not key:
            raise ValueError(f"--param needs KEY=VALUE or NAME.KEY=VALUE; got {item!r}")
        if target and target not in methods:
            raise ValueError(f"--param {item}: method '{target}' is not among the compared ({', '.join(methods)})")
        if not target and not any(key in gcomp.spec(m).params for m in methods):
            raise ValueError(f"--param {item}: none of {', '.join(methods)} has a parameter '{key}'")
        if target == name or (not target and key in accepted):
            out[key] = parse_value(text, accepted.get(key))
    return out


def load_data(seed: int):
    """Digits (1797 8x8 images, bundled with scikit-learn), standardised, a fixed 80/20 split."""
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(y))
    x, y = x[order].astype(np.float32), y[order].astype(np.int64)
    cut = int(0.8 * len(y))
    mean, std = x[:cut].mean(0), x[:cut].std(0)
    x = (x - mean) / np.where(std > 0, std, 1.0)
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    return (x[:cut], y[:cut]), (x[cut:], y[cut:])


def epoch_batches(train, rank: int, world: int, batch: int, seed: int, epoch: int):
    """This rank's batches of one epoch: a disjoint shard (examples r, r+N, r+2N, ...; equal sizes, so every
    rank takes the same number of steps) in an order seeded by the epoch."""
    per_rank = len(train[1]) // world
    shard = torch.arange(rank, per_rank * world, world)
    order = shard[torch.randperm(per_rank, generator=torch.Generator().manual_seed(seed + epoch))]
    for i in range(0, per_rank, batch):
        idx = order[i:i + batch]
        yield train[0][idx], train[1][idx]


def make_model(hidden: tuple[int, ...] = (128, 64)) -> nn.Module:
    widths = [64, *hidden]
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(widths[-1], 10))


def train_one(name: str, params: dict, args, train, test, log) -> dict:
    """Train a fresh model with method ``name``; return rank 0's view of the final loss, accuracy and stats."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = DistributedDataParallel(make_model(args.hidden))
    state = gcomp.install(model, name, **params)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    step, loss_sum, train_s = 0, torch.zeros(2), 0.0
    for epoch in range(args.epochs):
        loss_sum.zero_()
        for x, y in epoch_batches(train, rank, world, args.batch, args.seed, epoch):
            start = time.perf_counter()
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            train_s += time.perf_counter() - start
            loss_sum += torch.tensor([loss.item(), 1.0])
            step += 1
            if step == args.steps:
                break
        dist.all_reduce(loss_sum)  # mean training loss of this epoch over all ranks
        with torch.no_grad():
            accuracy = (model(test[0]).argmax(1) == test[1]).float().mean().item()
        loss_value = (loss_sum[0] / loss_sum[1]).item()
        log(f"[{name}] epoch {epoch + 1}/{args.epochs}  step {step:4d}  loss {loss_value:.4f}  "
            f"test accuracy {accuracy:.4f}  compression ratio {state.compression_ratio:.2f}x")
        if step == args.steps:
            break
    s = state.stats
    return {"method": name, "loss": loss_value, "accuracy": accuracy, "bytes_per_step": s["bytes_sent"] / s["steps"],
            "ratio": state.compression_ratio, "encode_s": s["encode_s"], "decode_s": s["decode_s"],
            "step_ms": 1000 * train_s / step}


def table(rows: list[dict]) -> str:
    head = (f"{'method':<12}{'final loss':>11}{'test accuracy':>15}{'bytes/step':>12}{'ratio':>9}"
            f"{'encode s':>10}{'decode s':>10}{'step ms':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['method']:<12}{r['loss']:>11.4f}{r['accuracy']:>15.4f}{r['bytes_per_step']:>12.0f}"
                     f"{r['ratio']:>8.2f}x{r['encode_s']:>10.4f}{r['decode_s']:>10.4f}{r['step_ms']:>9.2f}")
    return "\n".join(lines)


def run(args) -> None:
    """The body every worker runs, once its process group is up."""
    torch.set_num_threads(1)  # N workers share the machine's cores
    rank, world = dist.get_rank(), dist.get_world_size()
    log = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    train, test = load_data(args.seed)
    log(f"digits: {len(train[1])} train / {len(test[1])} test examples, {world} worker(s), "
        f"{len(train[1]) // world} examples each; methods: {', '.join(args.methods)}")
    rows = []
    for name in args.methods:
        log(f"== {name}" + (f" {args.method_params[name]}" if args.method_params[name] else ""))
        rows.append(train_one(name, args.method_params[name], args, train, test, log))
    log("\n" + table(rows))
    dist.barrier()  # no rank tears the process group down while another still uses it


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _spawned(rank: int, world: int, port: int, run, run_args: tuple) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        run(*run_args)
    finally:
        dist.destroy_process_group()


def launch(run, nproc: int, *run_args) -> None:
    """``run(*run_args)`` on every rank: in this process under torchrun (rank and world size from the
    environment), otherwise on ``nproc`` gloo workers spawned on 127.0.0.1 with a free port."""
    if under_torchrun():
        dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
        try:
            run(*run_args)
        finally:
            dist.destroy_process_group()
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_spawned, args=(nproc, port, run, run_args), nprocs=nproc, join=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    launch(run, args.nproc or 1, args)


if __name__ == "__main__":
    main()
