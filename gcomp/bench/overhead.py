"""``gcomp bench --overhead``: what a method adds to a real training step, beside plain DDP and PyTorch's hooks.

One rank per GPU (NCCL; with several GPUs each method's step includes the real link), or one CPU rank (gloo:
the collective moves nothing, so what a method adds is its codec). Every method in one run and one process per
rank, each with the same model from the same seed (``gcomp.bench.overhead_models``) wrapped in its own DDP, the
method installed: ``warmup`` steps each, then ``steps`` rounds in which every method takes one timed step in turn
(forward, backward and an SGD step on one synthetic batch, bf16 autocast on CUDA), so that whatever else the
machine does falls on all of them alike. Per method:

- ``step ms``: the median step (CUDA: device time between events, synchronised per step; CPU: wall);
- ``x DDP`` and ``added``: against plain DDP's median step in the same run;
- ``codec ms``: the method's own work per step (the median over the timed steps): gcomp's timers (encode,
  decode and the work between rounds: host seconds, so on a GPU the launches, which is where a host-bound codec
  shows), and for PyTorch's hooks the host time of the hook's call in the profiler (``profile_steps`` steps,
  mean), whose decode runs inside it;
- ``device ms`` (CUDA): the device time of the kernels the profiler attributes to the hook's call.

Methods that prune (``pactrain``, ``prunex``) train the model pruned by magnitude at 0.5 first (DDP's own row is
the unpruned model: the masks' multiply is part of what they add). On the CPU (gloo) PyTorch's PowerSGD hook runs
with one bucket, as in ``gcomp bench`` (with several in flight it deadlocks gloo). A method that fails leaves a row
with its ``error``.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile, record_function

import gcomp
from gcomp.bench import overhead_models as models
from gcomp.bench.methods import TorchHook, parse_method
from gcomp.bench.quiet import held_back_profiler_lines
from gcomp.bench.runner import free_port

PLAIN = "ddp"
DEFAULT_METHODS = ("fp16", "bf16", "pactrain", "randomk", "qsgd", "signsgd", "dgc", "topk", "terngrad", "onebit",
                   "pactrain:ternary=true", "powersgd", "torch:fp16", "torch:bf16", "torch:powersgd")
HOOK_RANGE = "gcomp.bench.hook"


@dataclass
class OverheadConfig:
    """One ``--overhead`` run: the model, the methods beside plain DDP, and how long each is timed."""

    model: str = ""
    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS))
    steps: int = 20
    warmup: int = 5
    profile_steps: int = 3
    batch: int = 0
    device: str = "cpu"
    seed: int = 0
    lr: float = 1e-3

    def resolved(self) -> "OverheadConfig":
        """Defaults by device: ResNet-50 (where torchvision is) or the GPT-2-small-sized decoder, batch 128 or 8,
        on CUDA; the MLP and batch 64 on the CPU. Checks what it is given."""
        cuda = self.device == "cuda"
        model = self.model or (("resnet50" if _has_torchvision() else "decoder") if cuda else "mlp")
        batch = self.batch or ((128 if model == "resnet50" else 8) if cuda else 64)
        for name, value, low in (("--steps", self.steps, 1), ("--warmup", self.warmup, 0),
                                 ("--profile-steps", self.profile_steps, 1), ("--batch", batch, 1)):
            if value < low:
                raise ValueError(f"gcomp bench --overhead: {name} must be at least {low}; got {value}")
        for text in self.methods:
            parse_method(text)  # an unknown name or a bad parameter: now, not in a worker
        return OverheadConfig(model, list(self.methods), self.steps, self.warmup, self.profile_steps, batch,
                              self.device, self.seed, self.lr)


def _has_torchvision() -> bool:
    try:
        import torchvision  # noqa: F401
    except ImportError:
        return False
    return True


def run(config: OverheadConfig) -> list[dict]:
    """Every method's row (plain DDP first), measured on one rank per GPU or one CPU rank; rank 0's figures."""
    config = config.resolved()
    models.build(config.model)  # a model that cannot be built fails here, before any process starts
    world = torch.cuda.device_count() if config.device == "cuda" else 1
    if world == 1:
        return _ranks(0, 1, free_port(), config)
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_spawned, args=(world, free_port(), config, queue), nprocs=world, join=True)
    return queue.get()


def _spawned(rank: int, world: int, port: int, config: OverheadConfig, queue) -> None:
    rows = _ranks(rank, world, port, config)
    if rank == 0:
        queue.put(rows)


def _ranks(rank: int, world: int, port: int, config: OverheadConfig) -> list[dict]:
    cuda = config.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=300))
    try:
        runs = [_Run(label, config, device) for label in [PLAIN, *config.methods]]
        for run in runs:
            run.do(run.warm, config.warmup)
        for _ in range(config.steps):  # one step of each method in turn: the machine's drift is everyone's
            for run in runs:
                run.do(run.timed)
        for run in runs:
            run.do(run.profiled, config.profile_steps)
        rows = [run.row() for run in runs]
        time.sleep(0.25)  # PyTorch's hooks' callbacks finish on gloo's threads (gcomp.bench.codec_hooks says why)
    finally:
        if started:
            dist.destroy_process_group()
    plain = rows[0].get("step_ms")
    for row in rows:
        if plain and row.get("step_ms"):
            row["x_ddp"] = row["step_ms"] / plain
            row["added_pct"] = 100.0 * (row["step_ms"] / plain - 1.0)
        row.update(model=config.model, batch=config.batch, world=world, device=device.type)
    return rows


class _Run:
    """One method's model, DDP, hook and optimizer, kept for the whole run; its steps, timed and profiled. A
    failure in any phase is kept as the row's ``error`` and its later phases are skipped."""

    def __init__(self, label: str, config: OverheadConfig, device: torch.device):
        self.label, self.device, self.error = label, device, None
        self.times: list[float] = []
        self.codecs: list[float] = []
        self.host_ms = self.device_ms = 0.0
        self.do(self._build, config)

    def do(self, fn, *args) -> None:
        if self.error is None:
            try:
                fn(*args)
            except Exception as err:  # noqa: BLE001 -- one method's failure is a row; the others go on
                self.error = f"{type(err).__name__}: {err}"

    def _build(self, config: OverheadConfig) -> None:
        device = self.device
        model, kind = models.build(config.model, config.seed)
        self.method = None if self.label == PLAIN else parse_method(self.label)
        if self.method is not None and self.method.prunes:
            gcomp.pruning.prune(model, 0.5, "magnitude")
        model = model.to(device)
        if kind == "image" and device.type == "cuda":
            model = model.to(memory_format=torch.channels_last)
        # PyTorch's PowerSGD hook deadlocks gloo with several buckets in flight: on the CPU it gets one
        one = self.method is not None and self.method.one_bucket and device.type != "cuda"
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda"
                                                        else None, **({"bucket_cap_mb": 1e6} if one else {}))
        self.timers = _attach(ddp, self.method)
        opt = torch.optim.SGD(ddp.parameters(), lr=config.lr)
        x, y = models.batch(model, kind, config.batch, device, config.seed)

        def step():
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                out = ddp(x)
            models.loss(out.float(), y).backward()
            opt.step()
        self.step = step

    def warm(self, steps: int) -> None:
        for _ in range(steps):
            self.step()

    def timed(self) -> None:
        before = self.timers()
        self.times.append(_timed(self.step, self.device))
        self.codecs.append(self.timers() - before)

    def profiled(self, steps: int) -> None:
        self.host_ms, self.device_ms = _profiled(self.step, self.device, steps)

    def row(self) -> dict:
        if self.error is not None:
            return {"method": self.label, "error": self.error}
        ours = self.method is not None and not self.method.is_torch
        row = {"method": self.label, "step_ms": 1e3 * statistics.median(self.times),
               "codec_ms": 1e3 * statistics.median(self.codecs) if ours else self.host_ms, "hook_ms": self.host_ms}
        if self.device.type == "cuda":
            row["device_ms"] = self.device_ms
        return row


def _attach(ddp, method) -> Callable[[], float]:
    """Install ``method`` (None: plain DDP) with its hook call traced as ``HOOK_RANGE``; returns a reader of the
    codec seconds so far (gcomp's timers; 0 for PyTorch's hooks and plain DDP)."""
    if method is None:
        return lambda: 0.0
    if method.is_torch:
        hook = TorchHook(method.name, ddp)
        inner = hook._hook

        def traced(state, bucket, _inner=inner):
            with record_function(HOOK_RANGE):
                return _inner(state, bucket)
        hook._hook = traced
        return lambda: 0.0
    state = gcomp.install(ddp, method.name, **method.params)
    reduce = state.reduce

    def traced_reduce(bucket):
        with record_function(HOOK_RANGE):
            return reduce(bucket)
    state.reduce = traced_reduce
    return lambda: state.stats["encode_s"] + state.stats["decode_s"] + state.stats["round_work_s"]


def _timed(step, device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    begin = time.perf_counter()
    step()
    return time.perf_counter() - begin


def _profiled(step, device: torch.device, steps: int) -> tuple[float, float]:
    """Host and device milliseconds per step inside the hook's calls (``HOOK_RANGE``), from the profiler."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with held_back_profiler_lines(), profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    rows = [e for e in prof.key_averages() if e.key == HOOK_RANGE]
    host = sum(e.cpu_time_total for e in rows) / steps / 1e3
    dev = sum(getattr(e, "device_time_total", 0.0) for e in rows) / steps / 1e3
    return host, dev


def markdown(rows: list[dict]) -> str:
    """The table of a run, one row per method, plain DDP first."""
    cuda = any(r.get("device") == "cuda" for r in rows)
    head = ["method", "step ms", "x DDP", "added", "codec ms"] + (["device ms"] if cuda else [])
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['method']} | error: {r['error'][:80]} |" + " |" * (len(head) - 2))
            continue
        cells = [r["method"], f"{r['step_ms']:.2f}", f"{r.get('x_ddp', float('nan')):.2f}",
                 f"{r.get('added_pct', float('nan')):+.0f}%", f"{r['codec_ms']:.2f}"]
        if cuda:
            cells.append(f"{r.get('device_ms', float('nan')):.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def as_dict(config: OverheadConfig) -> dict:
    return asdict(config)

