"""Run a comparison: pre-train once (cached), then N worker processes train every method under one harness.

Workers are separate processes started with ``python -m gcomp.bench.worker`` and an env:// rendezvous: on
127.0.0.1 when unshaped, or each inside its own network namespace behind a shaped veth link
(``gcomp.bench.netem``) when a bandwidth is given and shaping is permitted here.
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

from gcomp.bench.methods import parse_method
from gcomp.bench.workloads import MODELS, accuracy, load_data, loss_fn, make_model

DEFAULT_METHODS = ("identity", "fp16", "topk:ratio=0.01", "terngrad", "pactrain", "pactrain:ternary=true",
                   "torch:allreduce", "torch:fp16", "torch:powersgd")


@dataclass
class BenchConfig:
    """Everything that defines a comparison; identical for every method in it."""

    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS))
    dataset: str = "digits"
    model: str = "mlp:1024,1024"
    workers: int = 4
    bandwidth: str = "100mbit"
    steps: int = 60
    batch: int = 32
    lr: float = 0.02
    momentum: float = 0.9
    seed: int = 0
    eval_every: int = 10
    pretrain_epochs: int = 5
    prune_ratio: float = 0.5
    prune_method: str = "magnitude"
    bucket_cap_mb: float = 25.0
    target_accuracy: float | None = None
    data_dir: str | None = None
    cache_dir: str | None = None
    threads: int = 1
    timeout_s: int = 300
    verbose: bool = True

    def check(self) -> None:
        """Every setting checked before anything starts: a ValueError naming the setting and what it takes."""
        for key in ("workers", "steps", "batch", "eval_every", "threads", "timeout_s"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                name = f"--{key.replace('_', '-')}" if key in _FLAGS else f"setting {key!r}"
                raise ValueError(f"{name} must be a whole number of at least 1; got {value!r}")
        if not isinstance(self.pretrain_epochs, int) or self.pretrain_epochs < 0:
            raise ValueError(f"--pretrain-epochs must be a whole number of at least 0; got {self.pretrain_epochs!r}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"--lr must be a positive number; got {self.lr!r}")
        if not 0 <= self.prune_ratio < 1:
            raise ValueError(f"--prune-ratio must be in [0, 1); got {self.prune_ratio!r}")
        if self.target_accuracy is not None and not 0 < self.target_accuracy <= 1:
            raise ValueError(f"--target-accuracy must be in (0, 1]; got {self.target_accuracy!r}")
        name = self.model.partition(":")[0]
        if name not in MODELS:
            raise ValueError(f"unknown model {self.model!r}; choose one of {', '.join(MODELS)} (mlp:W1,W2 sets "
                             "its widths)")
        if name == "mlp" and ":" in self.model:
            widths = self.model.partition(":")[2].split(",")
            if not all(w.isdigit() and int(w) > 0 for w in widths):
                raise ValueError(f"--model {self.model!r}: an MLP's widths are positive whole numbers, mlp:W1,W2")
        if not self.methods:
            raise ValueError("no method to compare: --method takes a name or name:key=value")
        for text in self.methods:
            parse_method(text)


_FLAGS = ("workers", "steps", "batch", "eval_every")  # the settings gcomp bench takes as command-line flags


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now (for a rendezvous)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def pretrained_weights(config: BenchConfig, log=print) -> Path | None:
    """The pre-trained weights' file: loaded from the cache when the same pre-training was done before."""
    if config.pretrain_epochs <= 0:
        return None
    key = json.dumps([config.dataset, config.model, config.seed, config.pretrain_epochs, config.batch], sort_keys=True)
    cache = Path(config.cache_dir or Path.home() / ".cache" / "gcomp")
    path = cache / f"pretrained-{hashlib.sha1(key.encode()).hexdigest()[:12]}.pt"
    if path.exists():
        log(f"pre-trained {config.model} on {config.dataset}: cached at {path}")
        return path
    data = load_data(config.dataset, data_dir=config.data_dir, seed=config.seed)
    model = make_model(config.model, data, config.seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    start = time.perf_counter()
    for epoch in range(config.pretrain_epochs):
        order = torch.randperm(len(data.train[1]), generator=torch.Generator().manual_seed(10_000 + epoch))
        for i in range(0, len(order), config.batch):
            idx = order[i:i + config.batch]
            loss = loss_fn(model(data.train[0][idx]), data.train[1][idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(model.state_dict(), tmp)
    os.replace(tmp, path)
    log(f"pre-trained {config.model} on {config.dataset} for {config.pretrain_epochs} epochs in "
        f"{time.perf_counter() - start:.1f} s: test accuracy {accuracy(model, data.test):.4f} (cached at {path})")
    return path


def run(config: BenchConfig, out: Path, log=print) -> tuple[list[dict], str]:
    """Train every method; returns the rows and how the network was set up (a line for the report)."""
    from gcomp.bench import netem
    config.check()  # every setting and method spec checked before any worker starts
    load_data(config.dataset, data_dir=config.data_dir, seed=config.seed)  # a missing dataset fails here
    out.mkdir(parents=True, exist_ok=True)
    rate = netem.parse_rate(config.bandwidth)
    network = "unshaped (127.0.0.1)"
    shaped = None
    if rate is not None:
        ok, why = netem.permitted()
        if ok:
            shaped = netem.ShapedNetwork(config.workers, rate)
            network = f"shaped: {config.workers} namespaces, veth + tc tbf at {config.bandwidth} per link"
        else:
            log(why)
            network = f"unshaped (127.0.0.1): {why}"
    settings = asdict(config)
    settings.update(bandwidth=config.bandwidth if shaped else "none", bandwidth_bps=rate if shaped else None,
                    pretrained=str(pretrained_weights(config, log) or ""), output=str(out / "rows.json"))
    config_path = out / "worker-config.json"
    config_path.write_text(json.dumps(settings))
    if shaped is None:
        _launch(config, config_path, "127.0.0.1", None)
    else:
        with shaped:
            _launch(config, config_path, shaped.addresses[0], shaped)
    rows = json.loads((out / "rows.json").read_text())
    return rows, network


def _launch(config: BenchConfig, config_path: Path, master: str, shaped) -> None:
    port = free_port() if shaped is None else 29500 + os.getpid() % 1000
    procs = []
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
            procs.append(subprocess.Popen(argv, env=env))
        failed = [p.wait() for p in procs]
        if any(failed):
            raise RuntimeError(f"benchmark workers failed (exit codes {failed}); see their output above")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
