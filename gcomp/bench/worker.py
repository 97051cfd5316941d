"""One benchmark worker: ``python -m gcomp.bench.worker CONFIG.json`` on every rank (env:// rendezvous).

The config's ``jobs`` (a method, a seed, a prune ratio each) run in turn on the same process group; the methods
of one seed start from the same (pre-trained) weights, with the same data shards, batches, optimizer and
schedule. Per step, rank 0 records its wall time and the hook's
counters; the split into compute, encode, communicate and decode is:

- encode / decode: the hook's own host timers (``encode_s``, ``decode_s``);
- compute: forward + backward + optimizer with communication switched off (``ddp.no_sync()``), timed after
  the run on the same batches, as a median;
- communicate: the rest of the step (what DDP waited for); communication that overlaps backward is hidden.

On a GPU (``device: cuda``, the worker on ``cuda:LOCAL_RANK``, gloo or NCCL) every step and compute sample is
read off the host clock after ``torch.cuda.synchronize``, so it holds the kernels, not only their launches. The
hook's encode and decode timers read the host clock without synchronising (a synchronisation inside the hook
would stall DDP's overlap): on a GPU they hold the launches, and the kernels' own time lands in communicate.

Test accuracy is measured every ``eval_every`` steps on rank 0, outside the timed steps, and so is a bandwidth
schedule's change of rate (``gcomp.bench.rate_control``; each row then has its ``segments``: the mean step time
per rate). Rank 0 writes the rows to ``config["output"]``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import gcomp
from gcomp.bench.devices import synchronize, worker_device
from gcomp.bench.failures import recorded
from gcomp.bench.methods import BenchMethod, TorchHook, parse_method
from gcomp.bench.quiet import Progress, on_terminal, once_per_cause
from gcomp.bench.rate_control import NoSwitch, RateSwitch, worker_switch
from gcomp.bench.rate_schedule import segment_times
from gcomp.bench.straggler import ReadyClock, wait_for_peers
from gcomp.bench.throughput import probe_link, probe_loaded_latency
from gcomp.collectives.launch import COUNTER_KEYS
from gcomp.bench.workloads import Data, accuracy, load_data, loss_fn, make_model
from gcomp.pruning import no_buffer_sync
from gcomp.pruning import kept_fraction, prune

COMPUTE_SAMPLES = 5
# the hook's counters a row reports per step; the inter-node pair only for hierarchical methods (on a leader)
COUNTERS = ("bytes_sent", "bytes_dense", "encode_s", "decode_s", "inter_bytes", "inter_bytes_dense")
# what the communicators launched (gcomp.collectives.launch), per step in a row: what gcomp simulate prices
LAUNCHED = ("buckets", *COUNTER_KEYS)


def batches(data: Data, rank: int, world: int, batch: int, seed: int):
    """An endless, seeded stream of this rank's batches (its shard, reshuffled every epoch)."""
    x, y = data.shard(rank, world)
    epoch = 0
    while True:
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed * 7919 + epoch))
        for i in range(0, len(y) - batch + 1, batch):
            idx = order[i:i + batch]
            yield x[idx], y[idx]
        epoch += 1


def on_device(data: Data, device: torch.device) -> Data:
    """``data`` with its tensors on ``device``."""
    def move(pair):
        return None if pair is None else tuple(t.to(device) for t in pair)
    return dataclasses.replace(data, train=move(data.train), test=move(data.test), pretrain=move(data.pretrain))


def build(method: BenchMethod, config: dict, data: Data, pretrained: dict | None,
          device: torch.device = torch.device("cpu")):
    """The job's model (pre-trained weights, pruned where the method prunes) on ``device``, DDP around it and
    the method's hook; ``config`` holds the job's ``seed`` and ``prune_ratio``."""
    model = make_model(config["model"], data, config["seed"])
    if pretrained is not None:
        model.load_state_dict(pretrained)
    model.to(device)
    if method.prunes:
        prune(model, config["prune_ratio"], config["prune_method"], data=(data.train[0][:512], data.train[1][:512]),
              seed=config["seed"])
    if config.get("fsdp"):  # gcomp bench --fsdp: FSDP2 instead of DDP (gcomp.bench.fsdp)
        from gcomp.bench import fsdp
        sharded = fsdp.shard(model, device)
        return model, sharded, fsdp.install(method, sharded)
    # no_buffer_sync() for every method: DDP would otherwise re-send every pruning mask (as large as the weights)
    # from rank 0 at each forward; prune() already made the masks equal on every rank.
    ddp = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None,
                                  bucket_cap_mb=1e6 if method.one_bucket else config["bucket_cap_mb"],
                                  **no_buffer_sync())
    if method.is_torch:
        stats = TorchHook(method.name, ddp, seed=config["seed"]).stats
    else:
        stats = gcomp.install(ddp, method.name, **method.params).stats
    return model, ddp, stats


def run_method(method: BenchMethod, config: dict, data: Data, pretrained: dict | None, log,
               device: torch.device = torch.device("cpu"), switch: RateSwitch | NoSwitch = NoSwitch()) -> dict:
    """One job's run; ``switch`` changes the links' rate before the steps a bandwidth schedule names."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, ddp, stats = build(method, config, data, pretrained, device)
    fsdp = bool(config.get("fsdp"))
    ready = ReadyClock(None if fsdp else getattr(ddp, "_gcomp_state", None))  # when this rank's buckets were ready, per step
    opt = torch.optim.SGD(ddp.parameters(), lr=config["lr"], momentum=config["momentum"])
    stream = batches(data, rank, world, config["batch"], config["seed"])
    steps, kept = config["steps"], kept_fraction(model)
    times, losses, counters, history, clock = [], [], [], [], 0.0
    eval_every = config["eval_every"]
    bar = Progress(steps, method.label, on_terminal() and rank == 0 and config.get("verbose", True))
    for step in range(steps):
        x, y = next(stream)
        rate = switch.before_step(step)  # outside the step's time, as evaluations
        if rate is not None:
            log(f"  {method.label}: links at {rate} from step {step}")
        synchronize(device)  # a host clock times GPU work only once the device has caught up, at both ends
        start = time.perf_counter()
        loss = loss_fn(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        synchronize(device)
        elapsed = time.perf_counter() - start
        clock += elapsed
        times.append(elapsed)
        losses.append(loss.detach())
        counters.append({k: stats[k] for k in COUNTERS + LAUNCHED if k in stats})
        if (rank == 0 or fsdp) and ((step + 1) % eval_every == 0 or step + 1 == steps):
            # a sharded model's forward all-gathers its parameters: every rank evaluates with rank 0
            history.append({"step": step + 1, "train_s": clock, "accuracy": accuracy(model, data.test)})
        bar.update(f"accuracy {history[-1]['accuracy']:.3f}" if history else "")
    bar.close()
    compute = compute_time(ddp, opt, stream, device)
    wait = wait_for_peers(ready, steps // 2)  # over the steady half, as summarise's figures
    loaded = probe_loaded_latency(lambda: local_work(ddp, opt, stream), device=device)
    dist.barrier()
    row = {**summarise(method, config, times, losses, counters, history, compute, kept, world,
                       sum(p.numel() for p in model.parameters())), "wait_s_per_step": wait,
           "alpha_loaded_s": loaded}
    if config.get("rate_schedule"):
        row["segments"] = segment_times(times, config["rate_schedule"])
    state = None if fsdp else getattr(ddp, "_gcomp_state", None)
    if state is not None and hasattr(state.method, "choices"):  # auto: the method it chose per bucket
        row["auto_choices"] = state.method.choices()
        row["auto_events"] = list(state.method.events)
        row["auto_stats"] = {k: v for k, v in state.stats.items() if k.startswith("auto_")}
    return row


def local_work(ddp, opt, stream) -> None:
    """Forward and backward of one batch with no communication (``no_sync``); the gradients are dropped and
    the model does not move."""
    x, y = next(stream)
    with no_sync(ddp):
        loss_fn(ddp(x), y).backward()
    opt.zero_grad()


def no_sync(model):
    """No gradient communication for one forward and backward: DDP's ``no_sync``, or FSDP2's (``gcomp bench --fsdp``)."""
    if isinstance(model, DistributedDataParallel):
        return model.no_sync()
    from gcomp.bench import fsdp
    return fsdp.no_sync(model)


def compute_time(ddp, opt, stream, device: torch.device = torch.device("cpu")) -> float:
    """Median time of forward + backward + optimizer step with no communication (``no_sync``); the step is
    taken on zeroed gradients with lr 0, so the model does not move."""
    samples = []
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
    for _ in range(COMPUTE_SAMPLES):
        x, y = next(stream)
        synchronize(device)
        start = time.perf_counter()
        with no_sync(ddp):
            loss = loss_fn(ddp(x), y)
            opt.zero_grad()
            loss.backward()
        opt.step()
        synchronize(device)
        samples.append(time.perf_counter() - start)
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr
    opt.zero_grad()
    return statistics.median(samples)


def summarise(method, config, times, losses, counters, history, compute, kept, world, params) -> dict:
    """One results row. Per-step figures are means over the steady half of the run (the second half: past
    the hook's warm-up and pactrain's tracking steps)."""
    steps = len(times)
    half = steps // 2
    steady = range(half, steps)

    def per_step(key):
        before = counters[half - 1][key] if half else 0
        return (counters[-1][key] - before) / max(len(steady), 1)

    step_s = statistics.mean(times[half:]) if steps else 0.0
    encode, decode = per_step("encode_s"), per_step("decode_s")
    return {"method": method.label, "name": method.name, "params": method.params, "collective": method.collective,
            "seed": config["seed"], "prune_ratio": config["prune_ratio"] if method.prunes else None,
            "workers": world, "model": config["model"], "dataset": config["dataset"], "steps": steps,
            "bandwidth": config["bandwidth"], "bandwidth_bps": config["bandwidth_bps"],
            "step_s": step_s, "compute_s_per_step": compute, "encode_s_per_step": encode,
            "decode_s_per_step": decode, "comm_s_per_step": max(step_s - compute - encode - decode, 0.0),
            "bytes_sent_per_step": per_step("bytes_sent"), "bytes_dense_per_step": per_step("bytes_dense"),
            "bytes_sent_total": counters[-1]["bytes_sent"] if counters else 0,
            "train_s": sum(times), "final_loss": float(losses[-1]) if losses else None,
            "final_accuracy": history[-1]["accuracy"] if history else None, "history": history,
            "step_times": times, "losses": [float(v) for v in losses], "kept_fraction": kept, "parameters": params,
            "one_bucket": method.one_bucket,
            **{f"{key}_per_step": per_step(key) for key in ("inter_bytes", "inter_bytes_dense", *LAUNCHED)
               if counters and key in counters[-1]}}


def main(argv: list[str] | None = None) -> int:
    config = json.loads(open((argv or sys.argv[1:])[0]).read())
    device = worker_device(config.get("device", "cpu"), int(os.environ.get("LOCAL_RANK", 0)))
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's communicator and DDP use the current device
    dist.init_process_group(config.get("backend", "gloo"), timeout=timedelta(seconds=config.get("timeout_s", 300)))
    torch.set_num_threads(config.get("threads", 1))
    rank = dist.get_rank()
    log = (lambda text: print(text, flush=True)) if rank == 0 and config.get("verbose", True) else (lambda text: None)
    if rank > 0:  # every rank runs the same code on the same settings: rank 0's warnings speak for all
        warnings.simplefilter("ignore")
    try:
        link = probe_link(device=device)  # the path's alpha and beta, as this run's collectives see it
        data = on_device(load_data(config["dataset"], data_dir=config.get("data_dir"), seed=config["split_seed"]),
                         device)
        weights = {}
        rows = []
        switch = worker_switch(config, rank)  # one for every job: it knows the rate the last run left
        for job in config["jobs"]:
            text, seed = job["method"], job["seed"]
            path = config["pretrained"].get(str(seed))
            if path and path not in weights:
                weights[path] = torch.load(path, weights_only=True)
            method = parse_method(text)
            load_start = os.getloadavg()[0]
            if getattr(method, "outer", False):  # gcomp bench --outer: the same batches and row
                from gcomp.bench.outer_run import run_outer
                row = run_outer(method, {**config, **job}, data, weights.get(path), log, device, switch,
                                batches, summarise)
            else:
                row = run_method(method, {**config, **job}, data, weights.get(path), log, device, switch)
            tags = [f"seed {seed}"] if len(config["pretrained"]) > 1 else []
            if method.prunes:
                tags.append(f"prune ratio {job['prune_ratio']}")
            accuracy_text = "—" if row["final_accuracy"] is None else f"{row['final_accuracy']:.4f}"
            log(f"  {text}" + (f" ({', '.join(tags)})" if tags else "") + f": {row['steps']} steps, "
                f"{1000 * row['step_s']:.1f} ms/step, test accuracy {accuracy_text}")  # one line per run
            row["device"], row["backend"] = device.type, config.get("backend", "gloo")
            row["link"] = link
            row["load_average"] = {"start": load_start, "end": os.getloadavg()[0]}  # 1 minute, this machine
            rows.append(row)
        if rank == 0:
            with open(config["output"], "w") as fh:
                json.dump(rows, fh)
    finally:
        dist.destroy_process_group()
    return 0


def _exit_now(code: int) -> None:
    """End the process with ``code`` once its output is flushed, skipping the interpreter's shutdown: there,
    gloo's threads may still drop Python objects, and CPython (before 3.14) ends such a thread in the middle
    of a C++ destructor: "terminate called without an active exception", SIGABRT, a finished worker counted as
    failed (seen once in a full suite run; the rows are written and the group destroyed before this)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    with once_per_cause():
        code = recorded(main)  # an error is written for the parent's message, then raised
    _exit_now(code)
