"""PruneX on scikit-learn's bundled digits: ADMM structured pruning during DDP training, then compacted
inter-node all-reduce; compared with dense training over the same two-level topology.

One machine plays several nodes (``--ranks-per-node``, consecutive ranks). Two runs, with the same initial
weights, data shards, optimizer and learning-rate schedule (cosine over all steps):

1. ``dense``: ``gcomp.install(ddp, "hierarchical", inner="identity")``: the whole bucket is summed inside each
   node, all-reduced between node leaders, broadcast back;
2. ``prunex``: ``gcomp.install(ddp, "prunex")`` from the first step; after ``--admm-start`` epochs of plain
   training, ``gcomp.pruning.StructuredADMM`` adds ``rho/2 ||W - Z + U||^2`` to the loss for
   ``--admm-epochs`` epochs (Z: the top ``1 - --sparsity`` of each convolution's filters by norm, updated
   every ``--interval`` steps), then hard-prunes to Z's support and training goes on; prunex notices the new
   masks and compacts the inter-node all-reduce to the kept filters.

    python examples/prunex.py --nproc 4 --ranks-per-node 2
    torchrun --standalone --nproc_per_node 4 examples/prunex.py --ranks-per-node 2

Rank 0 (a node leader) prints a table and one line per run::

    RESULT run=prunex acc=0.9700 inter_bytes_per_step=93192 inter_ratio=0.4131 ...

``inter_bytes_per_step`` is the leader's inter-node payload per step over the last epoch; ``inter_ratio`` is
that over the dense run's; ``kept`` is the kept fraction of all parameters (the convolutions' filters,
with their biases, pruned; the classifier whole).
"""
from __future__ import annotations

import argparse
import math
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gcomp
from gcomp.pruning import StructuredADMM, kept_fraction
# examples/train.py: the digits data, shards and the launcher (torchrun or spawned workers)
from train import epoch_batches, launch, load_data, under_torchrun


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=None, help="spawn this many CPU workers (not with torchrun)")
    p.add_argument("--ranks-per-node", type=int, default=2, help="consecutive ranks per simulated node")
    p.add_argument("--sparsity", type=float, default=0.6, help="fraction of each convolution's filters pruned")
    p.add_argument("--epochs", type=int, default=40, help="epochs of each run")
    p.add_argument("--admm-start", type=int, default=10, help="epochs of plain training before ADMM starts")
    p.add_argument("--admm-epochs", type=int, default=15, help="epochs with the ADMM penalty, then the prune")
    p.add_argument("--rho", type=float, default=0.05, help="ADMM penalty weight")
    p.add_argument("--rho-growth", type=float, default=1.0, help="rho is multiplied by this at each update")
    p.add_argument("--interval", type=int, default=10, help="steps between ADMM updates of Z and U")
    p.add_argument("--batch", type=int, default=32, help="batch size per worker")
    p.add_argument("--lr", type=float, default=0.05, help="peak learning rate (cosine to 0)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if under_torchrun() and args.nproc is not None:
        p.error("--nproc spawns workers itself; under torchrun use --nproc_per_node instead")
    for flag, value, low in (("--nproc", 1 if args.nproc is None else args.nproc, 1), ("--epochs", args.epochs, 1),
                             ("--admm-epochs", args.admm_epochs, 0), ("--batch", args.batch, 1),
                             ("--ranks-per-node", args.ranks_per_node, 1), ("--interval", args.interval, 1)):
        if value < low:
            p.error(f"{flag} must be at least {low}; got {value}")
    if args.admm_start < 0 or args.admm_start + args.admm_epochs >= args.epochs:
        p.error(f"--admm-start ({args.admm_start}) + --admm-epochs ({args.admm_epochs}) must be below --epochs "
                f"({args.epochs}), and --admm-start at least 0: the pruned model trains on after the prune")
    if args.nproc is not None and args.nproc % args.ranks_per_node:
        p.error(f"--ranks-per-node ({args.ranks_per_node}) must divide --nproc ({args.nproc})")
    try:  # the ADMM's own checks, before any worker starts
        StructuredADMM(make_model(0), args.sparsity, rho=args.rho, interval=args.interval, rho_growth=args.rho_growth)
    except ValueError as err:
        p.error(str(err))
    return args


def make_model(seed: int) -> nn.Module:
    """A small CNN for 1x8x8 images: three 3x3 convolutions (32, 64, 64 filters) and a linear classifier."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                             nn.MaxPool2d(2), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                             nn.Flatten(), nn.Linear(64, 10))


def images(data):
    return data[0].view(-1, 1, 8, 8), data[1]


def accuracy(model: nn.Module, data) -> float:
    with torch.no_grad():
        return (model(data[0]).argmax(1) == data[1]).float().mean().item()


def train_run(name: str, args, train, test, log) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(args.seed)
    ddp = DistributedDataParallel(model)
    if name == "dense":
        state = gcomp.install(ddp, "hierarchical", inner="identity", ranks_per_node=args.ranks_per_node)
    else:
        state = gcomp.install(ddp, "prunex", ranks_per_node=args.ranks_per_node)
    admm = None
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=args.momentum)
    steps_per_epoch = -(-(len(train[1]) // world) // args.batch)
    total = args.epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    start, acc_at_prune, pruned_norm = time.perf_counter(), None, None
    for epoch in range(args.epochs):
        if name != "dense" and epoch == args.admm_start:  # Z starts as the projection of the weights reached
            admm = StructuredADMM(model, args.sparsity, rho=args.rho, interval=args.interval,
                                  rho_growth=args.rho_growth)
        if admm is not None and epoch == args.admm_start + args.admm_epochs:
            pruned_norm = admm.pruned_norm()
            acc_at_prune = accuracy(model, test)
            result = admm.prune(opt)
            log(f"[{name}] hard prune after {epoch} epochs: {result.removed} of {result.total} conv weights and "
                f"biases removed; |W| outside the kept filters was {pruned_norm:.4f} of |W|; test accuracy "
                f"{acc_at_prune:.4f} before, {accuracy(model, test):.4f} after")
        last_epoch = (state.stats["inter_bytes"], state.stats["steps"])
        for x, y in epoch_batches(train, rank, world, args.batch, args.seed, epoch):
            loss = nn.functional.cross_entropy(ddp(x), y)
            if admm is not None and not admm.pruned:
                loss = loss + admm.penalty()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            if admm is not None and not admm.pruned:
                admm.step()
        if (epoch + 1) % max(1, args.epochs // 6) == 0 or epoch + 1 == args.epochs:
            log(f"[{name}] epoch {epoch + 1}/{args.epochs}  test accuracy {accuracy(model, test):.4f}  "
                f"inter-node bytes so far {state.stats['inter_bytes']}")
    s = state.stats
    per_step = (s["inter_bytes"] - last_epoch[0]) / (s["steps"] - last_epoch[1])
    return {"run": name, "acc": accuracy(model, test), "kept": kept_fraction(model),
            "inter_bytes_per_step": per_step, "inter_bytes": s["inter_bytes"], "steps": s["steps"],
            "params": sum(p.numel() for p in model.parameters()), "acc_at_prune": acc_at_prune,
            "pruned_norm": pruned_norm, "unfreezes": s["unfreezes"] if "unfreezes" in s else None,
            "seconds": time.perf_counter() - start}


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def run(args) -> None:
    torch.set_num_threads(1)  # N workers share the machine's cores
    # The hard prune is this example's own doing, and it logs it: the tracker's warning would only repeat it.
    warnings.filterwarnings("ignore", message="prunex: the masks of bucket", category=RuntimeWarning)
    rank, world = dist.get_rank(), dist.get_world_size()
    log = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    train, test = (images(d) for d in load_data(args.seed))
    log(f"digits: {len(train[1])} train / {len(test[1])} test images, {world} workers as {world // args.ranks_per_node}"
        f" nodes x {args.ranks_per_node}, {args.epochs} epochs; prunex: ADMM from epoch {args.admm_start} for "
        f"{args.admm_epochs} epochs at "
        f"sparsity {args.sparsity} (rho {args.rho}, times {args.rho_growth} at each update; Z and U updated every "
        f"{args.interval} steps)")
    rows = [train_run(name, args, train, test, log) for name in ("dense", "prunex")]
    dense = rows[0]["inter_bytes_per_step"]  # 0 on followers: they send nothing across nodes
    for r in rows:
        r["inter_ratio"] = r["inter_bytes_per_step"] / dense if dense else float("nan")
    head = f"{'run':<8}{'test acc':>9}{'kept':>8}{'inter B/step, last epoch':>26}{'vs dense':>9}{'seconds':>9}"
    log("\n" + "\n".join([head, "-" * len(head)] + [
        f"{r['run']:<8}{r['acc']:>9.4f}{r['kept']:>8.4f}{r['inter_bytes_per_step']:>26.0f}{r['inter_ratio']:>9.4f}"
        f"{r['seconds']:>9.1f}" for r in rows]) + "\n")
    for r in rows:
        log(f"RESULT run={r['run']} acc={r['acc']:.4f} kept={r['kept']:.6f} "
            f"inter_bytes_per_step={r['inter_bytes_per_step']:.0f} inter_ratio={r['inter_ratio']:.6f} "
            f"inter_bytes={r['inter_bytes']} steps={r['steps']} params={r['params']} "
            f"acc_at_prune={_fmt(r['acc_at_prune'], '.4f')} pruned_norm={_fmt(r['pruned_norm'], '.6f')} "
            f"unfreezes={_fmt(r['unfreezes'], 'd')} seconds={r['seconds']:.1f}")
    dist.barrier()  # no rank tears the process group down while another still uses it


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    launch(run, args.nproc or 1, args)


if __name__ == "__main__":
    main()
