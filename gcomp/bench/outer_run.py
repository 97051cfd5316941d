"""One outer-loop job of the race (``gcomp bench --outer``): each worker trains its own copy of the model on its
shard with the inner optimizer (no per-step all-reduce) and calls ``gcomp.outer.DiLoCo.step`` after every inner
step; every ``every`` steps the outer gradient is reduced through the spec's method and the outer optimizer
steps.

The same initial weights, shards, batches and steps as the per-step methods. Per step, rank 0 records its wall
time, outer step included. What differs from a per-step row:

- **accuracy**: the model is evaluated (rank 0, outside the timed steps) right after each outer sync, where every
  rank holds the same parameters; that history gives time and steps to the target. Between syncs each rank's
  model has seen only its own shard: rank 0's is evaluated every ``eval_every`` steps too, as
  ``local_history``, which no race figure reads. With ``fragments`` above 1 only one fragment was just
  synced, so the model evaluated is rank 0's own.
- **per-step figures** are means over the whole run (a sync lands on one step in ``every``; a steady half would
  hold 2 or 3 of them by chance): ``step_s`` is the mean step, ``bytes_sent_per_step`` the bytes sent over all
  steps per inner step, ``bytes_dense_per_step`` what a per-step fp32 all-reduce hands to collectives per step
  (4 bytes a parameter), so ``compression`` reads as the bytes saved against per-step all-reduce;
  ``compute_s_per_step`` is the median step (a step with no sync) and ``comm_s_per_step`` the rest.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from gcomp.bench.devices import synchronize
from gcomp.bench.quiet import Progress, on_terminal
from gcomp.bench.workloads import accuracy, loss_fn, make_model


def inner_optimizer(method, model: torch.nn.Module, config: dict) -> torch.optim.Optimizer:
    """The spec's inner optimizer: SGD with the race's momentum, or AdamW (torch's defaults but the lr)."""
    lr = method.inner_lr(config["lr"])
    if method.params["inner"] == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr)
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=config["momentum"])


def outer_optimizer(method):
    """The outer optimizer, as ``DiLoCo`` takes it: params -> SGD (Nesterov where momentum is above 0)."""
    lr, momentum = method.params["lr"], method.params["momentum"]
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=momentum > 0)


def run_outer(method, config: dict, data, pretrained: dict | None, log, device: torch.device, switch,
              batches, summarise) -> dict:
    """One outer-loop job's row: ``summarise``'s keys (the worker's, which hands it and its ``batches`` over),
    with ``outer_steps``, ``sync_every`` and ``local_history``."""
    from gcomp.outer import DiLoCo
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(config["model"], data, config["seed"])
    if pretrained is not None:
        model.load_state_dict(pretrained)
    model.to(device)
    params = sum(p.numel() for p in model.parameters())
    opt = inner_optimizer(method, model, config)
    p = method.params
    outer = DiLoCo(model, sync_every=p["every"], method=p["method"], outer_optimizer=outer_optimizer(method),
                   fragments=p["fragments"], overlap=p["overlap"])
    stream = batches(data, rank, world, config["batch"], config["seed"])
    steps, eval_every = config["steps"], config["eval_every"]
    times, losses, counters, history, local, clock = [], [], [], [], [], 0.0
    bar = Progress(steps, method.label, on_terminal() and rank == 0 and config.get("verbose", True))
    for step in range(steps):
        x, y = next(stream)
        rate = switch.before_step(step)
        if rate is not None:
            log(f"  {method.label}: links at {rate} from step {step}")
        synchronize(device)
        start = time.perf_counter()
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        before = outer.stats["outer_steps"]
        outer.step()  # True on a launch too (overlap): an outer step applied is what is read
        synced = outer.stats["outer_steps"] > before
        synchronize(device)
        elapsed = time.perf_counter() - start
        clock += elapsed
        times.append(elapsed)
        losses.append(loss.detach())
        stats = outer.stats
        counters.append({"bytes_sent": stats["bytes_sent"], "bytes_dense": 4 * params * (step + 1),
                         "encode_s": stats.get("encode_s", 0.0), "decode_s": stats.get("decode_s", 0.0)})
        if rank == 0 and synced:
            history.append({"step": step + 1, "train_s": clock, "accuracy": accuracy(model, data.test)})
        if rank == 0 and ((step + 1) % eval_every == 0 or step + 1 == steps):
            local.append({"step": step + 1, "train_s": clock, "accuracy": accuracy(model, data.test)})
        bar.update(f"accuracy {history[-1]['accuracy']:.3f}" if history else "")
    bar.close()
    dist.barrier()
    row = summarise(method, config, times, losses, counters, history, statistics.median(times), 1.0, world,
                    params)
    step_s = statistics.mean(times)
    encode, decode = counters[-1]["encode_s"] / steps, counters[-1]["decode_s"] / steps
    row.update(step_s=step_s, bytes_sent_per_step=counters[-1]["bytes_sent"] / steps,
               bytes_dense_per_step=4.0 * params, encode_s_per_step=encode, decode_s_per_step=decode,
               comm_s_per_step=max(step_s - row["compute_s_per_step"] - encode - decode, 0.0),
               outer_steps=outer.stats["outer_steps"], sync_every=p["every"], local_history=local,
               inner_optimizer=p["inner"], inner_lr=method.inner_lr(config["lr"]),
               wait_s_per_step=None, alpha_loaded_s=None)
    return row
