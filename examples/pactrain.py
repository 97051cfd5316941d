"""PacTrain on scikit-learn's bundled digits: pre-train, prune, fine-tune with DDP; compare with dense fine-tuning.

The workflow of the paper (Wang, Wu, Li, Kutscher 2025), small enough for a laptop's CPU:

1. pre-train an MLP on the digits' train split, single process, no DDP, a fixed seed (or load it from
   ``--checkpoint PATH``; a missing file is written after pre-training, so the next run skips it);
2. on every worker, prune the pre-trained weights once with ``gcomp.pruning.prune`` (GraSP by default, ratio
   ``--prune-ratio``; rank 0 computes the masks and broadcasts them);
3. fine-tune the pruned model with DDP and ``gcomp.install(ddp, "pactrain", ternary=...)``: after a warm-up
   step and the mask tracker's few dense tracking steps, only the kept entries travel, packed densely;
4. for comparison, fine-tune the unpruned pre-trained model with plain DDP (no hook) under the same seed,
   data, shards and learning-rate schedule: "dense fine-tuning on the same data".

Two ways to start it (CPU, gloo):

    python examples/pactrain.py --nproc 4 --both
    torchrun --standalone --nproc_per_node 4 examples/pactrain.py --ternary --param clip=2.5

``--ternary`` runs pactrain with ternary quantisation, ``--both`` runs it without and with. ``--param
key=value`` (repeatable) sets any other pactrain parameter (``gcomp describe pactrain`` lists them).

Rank 0 prints, per run, the test accuracy before and after fine-tuning, ``bytes_sent / bytes_dense`` over
the whole fine-tuning and over the steps from the tracker's first freeze on (rank 0's hook statistics:
``bytes_dense`` counts every entry of the buckets, pruned ones included), the kept fraction of all the
model's parameters (``gcomp.pruning.kept_fraction``) and the tracker's counters; then one line per run::

    RESULT run=pactrain acc_before=0.9000 acc_after=0.9700 ratio=0.510000 ratio_frozen=0.503000 ...

(``n/a`` where a figure does not apply: plain DDP has no hook and no tracker).
"""
from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gcomp
from gcomp.pruning import kept_fraction, prune
# examples/train.py: the digits data, shards, --param parsing and the launcher (torchrun or spawned workers)
from train import epoch_batches, launch, load_data, method_params, under_torchrun

CHECKPOINT_FORMAT = "gcomp-example-pactrain/1"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=None, help="spawn this many CPU workers (not with torchrun)")
    p.add_argument("--ternary", action="store_true", help="run pactrain with ternary=True")
    p.add_argument("--both", action="store_true", help="run pactrain with ternary off and on")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="a pactrain parameter, e.g. clip=2.5 or stable_steps=10 (repeatable)")
    p.add_argument("--prune-ratio", type=float, default=0.5, help="fraction of the Linear weights pruned")
    p.add_argument("--prune-method", choices=("grasp", "magnitude", "random"), default="grasp")
    p.add_argument("--epochs", type=int, default=25, help="fine-tuning epochs")
    p.add_argument("--steps", type=int, default=0, help="stop each fine-tuning after this many steps (0: no limit)")
    p.add_argument("--batch", type=int, default=8, help="fine-tuning batch size per worker")
    p.add_argument("--lr", type=float, default=0.02, help="fine-tuning peak learning rate (cosine to 0)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=256, help="width of the MLP's two hidden layers")
    p.add_argument("--pretrain-epochs", type=int, default=20)
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="pre-trained weights: loaded if the file exists, else written after pre-training")
    args = p.parse_args(argv)
    if args.ternary and args.both:
        p.error("--both already runs pactrain with ternary off and on")
    args.variants = [False, True] if args.both else [args.ternary]
    try:
        args.method_params = method_params("pactrain", args.param, ["pactrain"])
        if "ternary" in args.method_params:
            raise ValueError("set ternary with --ternary or --both, not --param")
        for ternary in args.variants:
            gcomp.create("pactrain", ternary=ternary, **args.method_params)  # fail here, before any worker starts
    except ValueError as err:
        p.error(str(err))
    if under_torchrun() and args.nproc is not None:
        p.error("--nproc spawns workers itself; under torchrun use --nproc_per_node instead")
    for flag, value, low in (("--nproc", 1 if args.nproc is None else args.nproc, 1), ("--epochs", args.epochs, 1),
                             ("--batch", args.batch, 1), ("--steps", args.steps, 0), ("--hidden", args.hidden, 1),
                             ("--pretrain-epochs", args.pretrain_epochs, 0)):
        if value < low:
            p.error(f"{flag} must be at least {low}; got {value}")
    if not 0 <= args.prune_ratio < 1:
        p.error(f"--prune-ratio must be in [0, 1); got {args.prune_ratio}")
    return args


def make_model(hidden: int, seed: int) -> nn.Module:
    """An MLP 64-h-h-10; its initial weights come from ``seed`` without touching the global RNG's state."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                             nn.Linear(hidden, 10))


def accuracy(model: nn.Module, data) -> float:
    with torch.no_grad():
        return (model(data[0]).argmax(1) == data[1]).float().mean().item()


def pretrain(args, train) -> dict:
    """Plain single-process SGD on the train split; returns the model's state_dict."""
    model = make_model(args.hidden, args.seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    n = len(train[1])
    for epoch in range(args.pretrain_epochs):
        order = torch.randperm(n, generator=torch.Generator().manual_seed(10_000 + args.seed + epoch))
        for i in range(0, n, 32):
            idx = order[i:i + 32]
            loss = nn.functional.cross_entropy(model(train[0][idx]), train[1][idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model.state_dict()


def pretrained(args, train, test, log) -> dict:
    """The pre-trained weights: from ``--checkpoint`` if it exists, else pre-trained now (and saved there)."""
    config = {"hidden": args.hidden, "seed": args.seed, "pretrain_epochs": args.pretrain_epochs}
    if args.checkpoint is not None and args.checkpoint.exists():
        saved = torch.load(args.checkpoint, weights_only=True)
        if saved.get("format") != CHECKPOINT_FORMAT or saved.get("config") != config:
            raise SystemExit(f"{args.checkpoint} holds a pre-training with {saved.get('config')}, not {config}; "
                             "remove it or pass another --checkpoint")
        log(f"pre-trained weights loaded from {args.checkpoint} ({config})")
        return saved["model"]
    start = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same arithmetic as in a worker: spawned and torchrun runs agree
    try:
        state = pretrain(args, train)
    finally:
        torch.set_num_threads(threads)
    model = make_model(args.hidden, args.seed)
    model.load_state_dict(state)
    log(f"pre-trained MLP 64-{args.hidden}-{args.hidden}-10 for {args.pretrain_epochs} epochs in "
        f"{time.perf_counter() - start:.1f} s: test accuracy {accuracy(model, test):.4f}")
    if args.checkpoint is not None:
        tmp = args.checkpoint.with_name(args.checkpoint.name + ".tmp")
        torch.save({"format": CHECKPOINT_FORMAT, "config": config, "model": state}, tmp)
        os.replace(tmp, args.checkpoint)  # never a half-written checkpoint under the real name
        log(f"pre-trained weights saved to {args.checkpoint}")
    return state


def cosine(total: int):
    """The learning-rate factor at step ``s``: from 1 down to 0 along half a cosine over ``total`` steps."""
    return lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total) / total))


def finetune(name: str, ternary: bool | None, args, state_dict: dict, train, test, log) -> dict:
    """Fine-tune a fresh copy of the pre-trained model: pruned with pactrain, or dense with plain DDP (None)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(args.hidden, args.seed)
    model.load_state_dict(state_dict)
    if ternary is not None:
        result = prune(model, args.prune_ratio, args.prune_method, data=train, seed=args.seed)  # before DDP
        log(f"[{name}] {args.prune_method} pruned {result.removed} of {result.total} Linear weights "
            f"(ratio {args.prune_ratio})")
    kept = kept_fraction(model)
    acc_before = accuracy(model, test)
    ddp = DistributedDataParallel(model)
    state = None if ternary is None else gcomp.install(ddp, "pactrain", ternary=ternary, **args.method_params)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=args.momentum)
    per_rank = len(train[1]) // world  # equal shards: every rank takes the same number of steps
    steps_per_epoch = -(-per_rank // args.batch)
    total_steps = args.epochs * steps_per_epoch if not args.steps else min(args.steps, args.epochs * steps_per_epoch)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine(total_steps))
    log_every = max(1, args.epochs // 5)
    step, frozen_at, before_freeze, loss_sum = 0, None, (0, 0), torch.zeros(2)
    start = time.perf_counter()
    for epoch in range(args.epochs):
        loss_sum.zero_()
        for x, y in epoch_batches(train, rank, world, args.batch, args.seed, epoch):
            loss = nn.functional.cross_entropy(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            loss_sum += torch.tensor([loss.item(), 1.0])
            step += 1
            if state is not None and frozen_at is None:
                if state.stats["freezes"]:
                    frozen_at = step  # this step already went packed: the tracker freezes when it decides
                else:
                    before_freeze = (state.stats["bytes_sent"], state.stats["bytes_dense"])
            if step == total_steps:
                break
        dist.all_reduce(loss_sum)  # mean training loss of this epoch over all ranks
        if (epoch + 1) % log_every == 0 or step == total_steps or epoch + 1 == args.epochs:
            ratio = "" if state is None else f"  bytes_sent/bytes_dense {1 / state.compression_ratio:.4f}"
            log(f"[{name}] epoch {epoch + 1}/{args.epochs}  step {step:5d}  loss {loss_sum[0] / loss_sum[1]:.5f}  "
                f"test accuracy {accuracy(model, test):.4f}{ratio}")
        if step == total_steps:
            break
    seconds = time.perf_counter() - start
    out = {"run": name, "acc_before": acc_before, "acc_after": accuracy(model, test), "kept": kept, "steps": step,
           "params": sum(p.numel() for p in model.parameters()), "seconds": seconds}
    if state is None:
        out.update(ratio=1.0, ratio_frozen=None, frozen_at=None, freezes=None, unfreezes=None, packed_buckets=None,
                   mask_mismatches=None, codec_s=None)
    else:
        s = state.stats
        sent, dense = s["bytes_sent"] - before_freeze[0], s["bytes_dense"] - before_freeze[1]
        out.update(ratio=s["bytes_sent"] / s["bytes_dense"], ratio_frozen=sent / dense if frozen_at else None,
                   frozen_at=frozen_at, freezes=s["freezes"], unfreezes=s["unfreezes"],
                   packed_buckets=s["packed_buckets"], mask_mismatches=s["mask_mismatches"],
                   codec_s=s["encode_s"] + s["decode_s"])
    return out


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def result_line(r: dict) -> str:
    """The machine-readable summary of one run."""
    return (f"RESULT run={r['run']} acc_before={r['acc_before']:.4f} acc_after={r['acc_after']:.4f} "
            f"ratio={r['ratio']:.6f} ratio_frozen={_fmt(r['ratio_frozen'], '.6f')} kept={r['kept']:.6f} "
            f"params={r['params']} steps={r['steps']} frozen_at={_fmt(r['frozen_at'], 'd')} "
            f"freezes={_fmt(r['freezes'], 'd')} unfreezes={_fmt(r['unfreezes'], 'd')} "
            f"packed_buckets={_fmt(r['packed_buckets'], 'd')} mask_mismatches={_fmt(r['mask_mismatches'], 'd')} "
            f"codec_s={_fmt(r['codec_s'], '.3f')} seconds={r['seconds']:.1f}")


def table(rows: list[dict]) -> str:
    dense = rows[0]["acc_after"]
    head = (f"{'run':<18}{'acc before':>11}{'acc after':>10}{'vs dense':>9}{'kept':>8}{'sent/dense':>11}"
            f"{'- kept':>8}{'after freeze':>13}{'freezes':>8}{'seconds':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['run']:<18}{r['acc_before']:>11.4f}{r['acc_after']:>10.4f}"
                     f"{100 * (r['acc_after'] - dense):>+8.2f}p{r['kept']:>8.4f}{r['ratio']:>11.4f}"
                     f"{r['ratio'] - r['kept']:>+8.4f}{_fmt(r['ratio_frozen'], '.4f'):>13}"
                     f"{_fmt(r['freezes'], 'd'):>8}{r['seconds']:>8.1f}")
    return "\n".join(lines)


def run(args, state_dict: dict | None) -> None:
    """The body every worker runs, once its process group is up (``state_dict``: None under torchrun)."""
    torch.set_num_threads(1)  # N workers share the machine's cores
    rank, world = dist.get_rank(), dist.get_world_size()
    log = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    train, test = load_data(args.seed)
    if state_dict is None:  # torchrun: rank 0 pre-trains or loads, the others receive its weights
        box = [pretrained(args, train, test, log) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        state_dict = box[0]
    per_rank = len(train[1]) // world
    log(f"digits: {len(train[1])} train / {len(test[1])} test examples, {world} worker(s), {per_rank} examples and "
        f"{-(-per_rank // args.batch)} steps of batch {args.batch} each per epoch, {args.epochs} epochs")
    runs = [("dense", None)] + [("pactrain+ternary" if t else "pactrain", t) for t in args.variants]
    rows = []
    for name, ternary in runs:
        params = "plain DDP, unpruned" if ternary is None else f"ternary={ternary} {args.method_params or ''}"
        log(f"== {name} ({params.strip()})")
        rows.append(finetune(name, ternary, args, state_dict, train, test, log))
    log("\n" + table(rows) + "\n")
    for r in rows:
        log(result_line(r))
    dist.barrier()  # no rank tears the process group down while another still uses it


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    state_dict = None  # under torchrun, rank 0 pre-trains (or loads) and shares the weights in run()
    if not under_torchrun():
        train, test = load_data(args.seed)
        state_dict = pretrained(args, train, test, lambda *a: print(*a, flush=True))
    launch(run, args.nproc or 1, args, state_dict)


if __name__ == "__main__":
    main()
