"""Run a comparison: pre-train once per seed (cached), then N worker processes train every method under one
harness, for every seed and every point of a sweep.

Workers are separate processes started with ``python -m gcomp.bench.worker`` and an env:// rendezvous: on
127.0.0.1 when unshaped, or each inside its own network namespace behind a shaped veth link
(``gcomp.bench.netem``) when a bandwidth is given and shaping is permitted here. One launch of the workers per
bandwidth runs a list of jobs (method, seed, prune ratio): every method for every seed at the first prune
ratio, and only the methods that prune at the sweep's other ratios (the others do not depend on it). A bandwidth
schedule (``gcomp.bench.rate_schedule``) is one launch whose links change rate as the runs go
(``gcomp.bench.rate_control``).

``device="cuda"`` puts each worker on ``cuda:LOCAL_RANK`` (pre-training stays on the CPU); ``backend="nccl"``
needs it and a GPU per worker, and refuses a shaped bandwidth (``BenchConfig.check`` says why).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from gcomp.bench import failures
from gcomp.bench.methods import parse_method
from gcomp.bench.rate_control import RateController
from gcomp.bench.rate_schedule import describe_schedule, is_schedule, parse_schedule
from gcomp.bench.workloads import MODELS, accuracy, load_data, loss_fn, make_model
from gcomp.link import parse_rate

DEFAULT_METHODS = ("identity", "fp16", "topk:ratio=0.01", "terngrad", "pactrain", "pactrain:ternary=true",
                   "torch:allreduce", "torch:fp16", "torch:powersgd")
PRUNE_METHODS = ("grasp", "magnitude", "random")  # gcomp.pruning.prune's methods


@dataclass
class BenchConfig:
    """Everything that defines a comparison; identical for every method in it.

    The default is the PacTrain scenario at a size that races on 2 cores: an MLP pre-trained on the digits 0-4,
    pruned with GraSP on the new task's data (by the methods that prune), fine-tuned on the digits 5-9 over
    100 Mbit links. ``bandwidth`` may list several rates ("100mbit,1gbit") and ``prune_ratio`` several ratios:
    a sweep. ``seeds`` runs every method that many times, with seeds ``seed``, ``seed + 1``, ... (initialisation,
    pre-training and data order; the train/test split stays the one of ``seed``)."""

    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS))
    dataset: str = "digits-transfer"
    model: str = "mlp:512,512"
    workers: int = 4
    bandwidth: str = "100mbit"
    steps: int = 240
    batch: int = 32
    lr: float = 0.004
    momentum: float = 0.9
    seed: int = 0
    seeds: int = 1
    eval_every: int = 6
    pretrain_epochs: int = 5
    prune_ratio: float | list[float] = 0.5
    prune_method: str = "grasp"
    bucket_cap_mb: float = 25.0
    target_accuracy: float | None = None
    data_dir: str | None = None
    cache_dir: str | None = None
    threads: int = 1
    timeout_s: int = 300
    verbose: bool = True
    device: str = "cpu"  # or "cuda": worker LOCAL_RANK on cuda:LOCAL_RANK (gcomp.bench.devices)
    backend: str = "gloo"  # or "nccl": CUDA only, one GPU per worker, no shaping
    fsdp: bool = False  # the race under FSDP2 (fully_shard) instead of DDP: gcomp.bench.fsdp

    def check(self) -> None:
        """Every setting checked before anything starts: a ValueError naming the setting and what it takes."""
        for key in ("workers", "steps", "batch", "eval_every", "seeds", "threads", "timeout_s"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                name = f"--{key.replace('_', '-')}" if key in _FLAGS else f"setting {key!r}"
                raise ValueError(f"{name} must be a whole number of at least 1; got {value!r}")
        if not isinstance(self.pretrain_epochs, int) or self.pretrain_epochs < 0:
            raise ValueError(f"--pretrain-epochs must be a whole number of at least 0; got {self.pretrain_epochs!r}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"--lr must be a positive number; got {self.lr!r}")
        if self.prune_method not in PRUNE_METHODS:
            raise ValueError(f"--prune-method must be one of {', '.join(PRUNE_METHODS)}; got {self.prune_method!r}")
        ratios = self.prune_ratios()
        if not ratios or not all(isinstance(r, (int, float)) and not isinstance(r, bool) and 0 <= r < 1
                                 for r in ratios):
            raise ValueError(f"--prune-ratio takes ratios in [0, 1), one or a comma-separated sweep; got "
                             f"{self.prune_ratio!r}")
        if len(set(ratios)) != len(ratios):
            raise ValueError(f"--prune-ratio lists a ratio twice: {self.prune_ratio!r}")
        from gcomp.bench import devices
        if is_schedule(self.bandwidth):
            rates = [s.rate for s in parse_schedule(self.bandwidth, self.steps)]  # a ValueError saying what is wrong
        else:
            rates = self.bandwidths()
            if len(set(rates)) != len(rates) or not rates:
                raise ValueError(f"--bandwidth lists a rate twice or none: {self.bandwidth!r}")
            if len(rates) > 1 and "none" in rates:
                raise ValueError("--bandwidth: a sweep compares shaped rates; 'none' cannot be one of its points")
            for rate in rates:
                parse_rate(rate)  # a ValueError naming the rate and the form it takes
        devices.check_device(self.device)
        devices.check_backend(self.backend, self.device, self.workers)
        if self.backend == "nccl" and any(parse_rate(rate) is not None for rate in rates):
            # NCCL between GPUs of one host moves data over NVLink, PCIe or shared memory, never through the
            # namespaces' veth links that tc shapes: a "shaped" NCCL race would be unshaped under its label.
            raise ValueError(f"--bandwidth {self.bandwidth}: shaping applies to gloo's TCP links only; NCCL on "
                             "one host bypasses them. Use --bandwidth none with --backend nccl, or --backend gloo "
                             "to shape")
        if self.target_accuracy is not None and not 0 < self.target_accuracy <= 1:
            raise ValueError(f"--target-accuracy must be in (0, 1]; got {self.target_accuracy!r}")
        name = self.model.partition(":")[0]
        if name not in MODELS:
            raise ValueError(f"unknown model {self.model!r}; choose one of {', '.join(MODELS)} (mlp:W1,W2 sets "
                             "its widths)")
        option = self.model.partition(":")[2]
        if name == "mlp" and ":" in self.model:
            widths = option.split(",")
            if not all(w.isdigit() and int(w) > 0 for w in widths):
                raise ValueError(f"--model {self.model!r}: an MLP's widths are positive whole numbers, mlp:W1,W2")
        if name in ("resnet18", "vgg19") and ":" in self.model and not (option.isdigit() and int(option) > 0):
            raise ValueError(f"--model {self.model!r}: the option is a base width, a positive whole number "
                             f"({name}:16)")
        if name in ("vit", "charlm") and ":" in self.model:
            raise ValueError(f"--model {self.model!r}: {name} takes no option")
        if not self.methods:
            raise ValueError("no method to compare: --method takes a name or name:key=value")
        methods = [parse_method(text) for text in self.methods]
        if self.fsdp:
            from gcomp.bench import fsdp
            fsdp.check_methods(self.methods)
        if len(ratios) > 1 and not any(m.prunes for m in methods):
            raise ValueError(f"--prune-ratio sweeps {len(ratios)} ratios, but no method compared prunes "
                             "(pactrain, prunex): add one")

    def bandwidths(self) -> list[str]:
        """The rates of the comparison: one, or the points of a bandwidth sweep; a schedule
        (``gcomp.bench.rate_schedule``) is one point."""
        entries = [r.strip() for r in str(self.bandwidth).split(",") if r.strip()]
        return [",".join(entries)] if is_schedule(self.bandwidth) else entries

    def rate_schedule(self) -> list[dict] | None:
        """The bandwidth schedule's segments (``Segment.as_dict()``), or None for one rate or a sweep."""
        if not is_schedule(self.bandwidth):
            return None
        return [s.as_dict() for s in parse_schedule(self.bandwidth, self.steps)]

    def prune_ratios(self) -> list[float]:
        """The prune ratios of the comparison: one, or the points of a prune-ratio sweep."""
        return list(self.prune_ratio) if isinstance(self.prune_ratio, (list, tuple)) else [self.prune_ratio]

    def seed_list(self) -> list[int]:
        return list(range(self.seed, self.seed + self.seeds))

    def jobs(self) -> list[dict]:
        """What one launch of the workers runs, in order: every method for every seed at the first prune
        ratio; at the sweep's other ratios only the methods that prune."""
        methods = [(text, parse_method(text).prunes) for text in self.methods]
        return [{"method": text, "seed": seed, "prune_ratio": ratio}
                for seed in self.seed_list()
                for i, ratio in enumerate(self.prune_ratios())
                for text, prunes in methods if i == 0 or prunes]


_FLAGS = ("workers", "steps", "batch", "eval_every")  # the settings gcomp bench takes as command-line flags


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now (for a rendezvous)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def pretrained_weights(config: BenchConfig, log=print, seed: int | None = None) -> Path | None:
    """The pre-trained weights' file for ``seed`` (initialisation and data order; default ``config.seed``),
    on the split of ``config.seed``: loaded from the cache when the same pre-training was done before."""
    if config.pretrain_epochs <= 0:
        return None
    seed = config.seed if seed is None else seed
    key = [config.dataset, config.model, config.seed, config.pretrain_epochs, config.batch]
    key = json.dumps(key if seed == config.seed else key + [seed], sort_keys=True)
    cache = Path(config.cache_dir or Path.home() / ".cache" / "gcomp")
    path = cache / f"pretrained-{hashlib.sha1(key.encode()).hexdigest()[:12]}.pt"
    if path.exists():
        log(f"pre-trained {config.model} on {config.dataset} (seed {seed}): cached at {path}")
        return path
    data = load_data(config.dataset, data_dir=config.data_dir, seed=config.seed)
    source = data.pretrain if data.pretrain is not None else data.train
    model = make_model(config.model, data, seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    start = time.perf_counter()
    for epoch in range(config.pretrain_epochs):
        order = torch.randperm(len(source[1]), generator=torch.Generator().manual_seed(
            10_000 + epoch + 1000 * (seed - config.seed)))
        for i in range(0, len(order), config.batch):
            idx = order[i:i + config.batch]
            loss = loss_fn(model(source[0][idx]), source[1][idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(model.state_dict(), tmp)
    os.replace(tmp, path)
    task = "the pre-training task's" if data.pretrain is None else "the fine-tuning task's (not yet trained on)"
    log(f"pre-trained {config.model} on {config.dataset} (seed {seed}) for {config.pretrain_epochs} epochs in "
        f"{time.perf_counter() - start:.1f} s: {task} test accuracy {accuracy(model, data.test):.4f} "
        f"(cached at {path})")
    return path


def run(config: BenchConfig, out: Path, log=print) -> tuple[list[dict], str]:
    """Train every job at every bandwidth; returns the rows (each tagged with its ``seed``, ``prune_ratio`` and
    ``network``) and how the network was set up (a line for the report)."""
    from gcomp.bench import netem
    config.check()  # every setting and method spec checked before any worker starts
    load_data(config.dataset, data_dir=config.data_dir, seed=config.seed)  # a missing dataset fails here
    out.mkdir(parents=True, exist_ok=True)
    pretrained = {seed: str(pretrained_weights(config, log, seed) or "") for seed in config.seed_list()}
    rows, networks = [], []
    schedule = config.rate_schedule()
    for point, bandwidth in enumerate(config.bandwidths()):
        rate = schedule[0]["rate_bps"] if schedule else parse_rate(bandwidth)
        network = "unshaped (127.0.0.1)"
        shaped = None
        if rate is not None:
            ok, why = netem.permitted()
            if ok:
                shaped = netem.ShapedNetwork(config.workers, rate)
                at = f"per link at {describe_schedule(schedule)}" if schedule else f"at {bandwidth} per link"
                network = f"shaped: {config.workers} namespaces, veth + tc tbf {at}"
            else:
                log(why)
                network = f"unshaped (127.0.0.1): {why}"
        if len(config.bandwidths()) > 1:
            log(f"=== bandwidth {bandwidth} ({point + 1} of {len(config.bandwidths())}): {network}")
        settings = asdict(config)
        # a schedule's runs have no one rate to price them at: no bandwidth_bps, as for unshaped runs
        settings.update(bandwidth=bandwidth if shaped else "none",
                        bandwidth_bps=rate if shaped and not schedule else None,
                        rate_schedule=schedule, rate_schedule_applied=bool(schedule and shaped),
                        split_seed=config.seed, jobs=config.jobs(), pretrained=pretrained,
                        output=str(out / f"rows-{point}.json"))
        config_path = out / f"worker-config-{point}.json"
        config_path.write_text(json.dumps(settings))
        if shaped is None:
            _launch(config, config_path, "127.0.0.1", None)
        elif schedule:
            with shaped, RateController(lambda step, rate_bps: shaped.set_rate(rate_bps)) as controller:
                _launch(config, config_path, shaped.addresses[0], shaped, controller)
        else:
            with shaped:
                _launch(config, config_path, shaped.addresses[0], shaped)
        point_rows = json.loads((out / f"rows-{point}.json").read_text())
        for row in point_rows:
            row["network"] = network
        rows += point_rows
        networks.append(network)
    unique = list(dict.fromkeys(networks))
    if len(unique) > 1 and all(n.startswith("shaped:") for n in unique):
        return rows, (f"shaped: {config.workers} namespaces, veth + tc tbf per link at "
                      f"{', '.join(config.bandwidths())}")
    return rows, unique[0] if len(unique) == 1 else "; ".join(unique)


def _launch(config: BenchConfig, config_path: Path, master: str, shaped,
            controller: RateController | None = None) -> None:
    port = free_port() if shaped is None else 29500 + os.getpid() % 1000
    procs = []
    failures.clear(config_path, config.workers)
    try:
        for rank in range(config.workers):
            env = dict(os.environ, MASTER_ADDR=master, MASTER_PORT=str(port), RANK=str(rank),
                       WORLD_SIZE=str(config.workers), LOCAL_RANK=str(rank), OMP_NUM_THREADS=str(config.threads))
            argv = [sys.executable, "-m", "gcomp.bench.worker", str(config_path)]
            if shaped is not None:
                env.update(shaped.env(rank))
                # c10d warns, once per worker, that a namespace's address has no host name: true and harmless
                env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
                argv = shaped.prefix_command(rank, argv)
            if controller is not None and rank == 0:  # rank 0 asks the parent for each change of rate
                env.update(controller.env)
                procs.append(subprocess.Popen(argv, env=env, pass_fds=controller.child_fds))
                controller.launched()
            else:
                procs.append(subprocess.Popen(argv, env=env))
        failures.check([p.wait() for p in procs], config_path)  # WorkersFailed, naming the first worker's error
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
