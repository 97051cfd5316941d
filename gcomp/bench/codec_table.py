"""``gcomp bench --codec``: what every registered method costs per bucket, as a ratio to a plain copy.

For each method (its defaults) and bucket size, on a one-rank gloo group (so every collective is a local
copy and only the method's own work remains), the hook reduces one fp32 bucket, timed against
``dst.copy_(bucket)`` into a preallocated tensor: the memory-traffic floor any codec pays at least once.

- ``encode + decode / copy``: the hook's own timers (compress with error feedback, then decode), per bucket;
  methods that do their work inside the exchange (the point-to-point schedules) show it in the next column;
- ``reduce / copy``: the whole reduction of the bucket on one rank (encode, local collectives, decode);
- ``bits per entry``: the bytes the method hands to collectives per bucket entry, times 8, on one rank;
- ``floor``: the memory traffic any codec with that output must pay, as a multiple of one copy (read 4 and
  write 4 bytes per entry): the bucket read once by the encoder and written once by the decoder, the payload
  written once and read once (``bits`` each way), and, for a method whose memory keeps a residual, that
  residual read and written once more: ``1 + bits / 32`` plus 1 with such a memory; 0 for ``identity``, which
  hands the bucket over as it is. Residuals a compressor keeps itself are not counted (a lower floor). The
  distance between ``encode + decode / copy`` and the floor is what a codec could still gain.

``pactrain`` runs on a bucket pruned at random at 0.5 and ``prunex`` on one with half its rows pruned, both
after their tracker froze the support; every other method on a dense random bucket. Beside every registered
method with its defaults, the other ``mx`` element widths (``mxfp6_e3m2``, ``mxfp4``, ``nvfp4``),
``pactrain:ternary=true`` and PyTorch's ``powerSGD_hook`` on the same bucket
(``torch:powersgd``, rank 2: ``codec_hooks``; it has no codec timers, so its ``encode+decode`` cell is n/a). Times are medians,
operations interleaved within every repeat (``gcomp.bench.timing.median_times``): wall-clock on the CPU.

- ``reduce GB/s``: the bucket's bytes over the reduction's time (``copy GB/s`` likewise for the copy, printed
  under the table);
- ``peak extra / bucket``: the most memory the reduction holds at once beyond the bucket and what the method
  already held (its residuals, buffers kept from earlier steps; measured after the timed runs), as a fraction
  of the bucket's bytes; a reduction that returns a fresh tensor counts it;
- ``largest allocation / bucket``: the largest single allocation during the reduction, the same way; above 1
  breaks the rule that no codec allocates more than its bucket per step.
  On the CPU both come from the profiler's allocation events, on CUDA the peak from
  ``torch.cuda.max_memory_allocated`` (reset before the reduction) and the largest from the profiler's events
  on the device (``gcomp.bench.allocations``); the collective backend's own buffers are not seen.

``device="cuda"`` (``gcomp bench --codec --device cuda``) runs the same on CUDA tensors of the current device on
a one-rank NCCL group: times are device time between CUDA events (``timing.CudaEventClock``: synchronised
before, recorded around each sample), so ``reduce / copy`` is against a device ``copy_``. The hook's own
encode and decode timers read the host clock, which on a GPU sees kernel launches, not the kernels: the
``encode+decode / copy`` column is then labelled "host" and ``reduce / copy`` is the one to read.

A method that fails leaves a row with its ``error`` (and the others go on): the table shows "error".
"""
from __future__ import annotations

import math
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import prune as torch_prune

import gcomp
from gcomp.bench.allocations import measure_allocations
from gcomp.bench import codec_hooks
from gcomp.bench.codec_hooks import TorchHookState
from gcomp.bench.quiet import Progress
from gcomp.bench.runner import free_port
from gcomp.bench.timing import CudaEventClock, median_times
from gcomp.registry import parse_spec

ROW_WIDTH = 256  # the pruned buckets are (numel / 256, 256) weights
FROZEN_AFTER = 4  # reductions before timing: pactrain/prunex (stable_steps=1) have frozen by then
# beside every registered method's defaults
EXTRA_ROWS = ("mx:format=mxfp6_e3m2", "mx:format=mxfp4", "mx:format=nvfp4", "pactrain:ternary=true", "torch:powersgd")


class _Bucket:
    """What ``HookState.reduce`` reads of a ``dist.GradBucket``."""

    def __init__(self, buffer: torch.Tensor, param: nn.Parameter):
        self._buffer, self._params = buffer, [param]

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True

    def parameters(self) -> list[nn.Parameter]:
        return self._params

    def gradients(self) -> list[torch.Tensor]:
        return [self._buffer.view(self._params[0].shape)]


def _holder(name: str, numel: int, generator: torch.Generator) -> nn.Module:
    layer = nn.Linear(ROW_WIDTH, numel // ROW_WIDTH, bias=False)
    if name == "pactrain":
        mask = (torch.rand(layer.weight.shape, generator=generator) >= 0.5).float()
        torch_prune.custom_from_mask(layer, "weight", mask)
    elif name == "prunex":
        rows = (torch.rand(layer.weight.shape[0], generator=generator) >= 0.5).float()
        torch_prune.custom_from_mask(layer, "weight", rows[:, None].expand_as(layer.weight).contiguous())
    return layer


def table_device(device: str | torch.device) -> torch.device:
    """``device`` with a CUDA device's index filled in (the current one): ``torch.cuda.set_device`` wants it."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def check_sizes(sizes_mb) -> None:
    """A ValueError for a bucket size below one row of ``ROW_WIDTH`` fp32 entries (1 KiB), which the table
    would round up to that row."""
    smallest = ROW_WIDTH * 4 / 2**20
    small = [s for s in sizes_mb if not s >= smallest]
    if small:
        raise ValueError(f"--sizes-mb {' '.join(f'{s:g}' for s in small)}: a bucket holds one row of {ROW_WIDTH} "
                         f"fp32 entries at least, {smallest:g} MB (1 KiB); give sizes of that or more")


def bucket_numel(size_mb: float) -> int:
    """The entries of an fp32 bucket of about ``size_mb`` MiB, whole rows of ``ROW_WIDTH``, one row at least."""
    return max(ROW_WIDTH, int(size_mb * 2**20) // 4 // ROW_WIDTH * ROW_WIDTH)


def one_rank_group(device: torch.device) -> bool:
    """Start a one-rank group (gloo; NCCL for a CUDA device) unless one is running; True when this call
    started it."""
    if dist.is_initialized():
        return False
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=120))
    return True


def reducer(spec: str, numel: int, generator: torch.Generator, device="cpu"):
    """``(state, reduce, source)``: the hook state of method ``spec`` (a name with its defaults, or
    ``name:key=value,...``; ``torch:powersgd``: PyTorch's hook, ``codec_hooks``) on a bucket of ``numel`` fp32
    entries on ``device``, warmed up until its support is frozen, and ``reduce()``, which refills the bucket from
    ``source`` and reduces it through the hook (a one-rank group must be running)."""
    device = torch.device(device)
    name, params = (spec, {}) if spec.startswith("torch:") else parse_spec(spec)
    model = _holder(name, numel, generator).to(device)
    param = next(model.parameters())
    ddp = nn.parallel.DistributedDataParallel(model)
    if name.startswith("torch:"):
        state = TorchHookState(name, ddp)
    else:
        params = {**({"stable_steps": 1} if name in ("pactrain", "prunex") else {}), **params}
        state = gcomp.HookState(gcomp.create(name, **params), ddp, None)
        state.warmup = 0
    source = torch.randn(numel, generator=generator).to(device)
    if name == "pactrain":
        source.mul_(model.weight_mask.reshape(-1))
    buffer = torch.empty_like(source)

    def reduce():
        buffer.copy_(source)
        return state.reduce(_Bucket(buffer, param)).wait()

    for _ in range(FROZEN_AFTER):
        reduce()
    return state, reduce, source


def measure(name: str, numel: int, repeats: int, generator: torch.Generator, device="cpu") -> dict:
    device = torch.device(device)
    state, reduce, source = reducer(name, numel, generator, device)
    dst = torch.empty_like(source)
    before = dict(state.stats)
    clock = CudaEventClock() if device.type == "cuda" else time.perf_counter
    times = median_times({"copy": lambda: dst.copy_(source), "reduce": reduce}, repeats, clock)
    calls = state.stats["buckets"] - before["buckets"]
    codec = (state.stats["encode_s"] + state.stats["decode_s"] - before["encode_s"] - before["decode_s"]) / calls
    sent = (state.stats["bytes_sent"] - before["bytes_sent"]) / calls
    memory = measure_allocations(reduce, device)
    bucket_bytes = numel * source.element_size()
    copy_s = times["copy"]
    reduce_s = times["reduce"] - copy_s  # less the refill of the bucket
    bits = 8 * sent / numel
    return {"method": name, "device": device.type, "size_mb": bucket_bytes / 2**20, "copy_s": copy_s,
            "codec_s": codec, "codec_clock": "host" if device.type == "cuda" else "wall",
            "codec_ratio": codec / copy_s, "reduce_s": reduce_s, "reduce_ratio": reduce_s / copy_s,
            "copy_gbps": gbps(bucket_bytes, copy_s), "reduce_gbps": gbps(bucket_bytes, reduce_s),
            "bits_per_entry": bits, "floor": floor(name, bits, _error_feedback(state)),
            "peak_extra_frac": memory.peak_extra_bytes / bucket_bytes,
            "largest_alloc_frac": memory.largest_bytes / bucket_bytes}


def _error_feedback(state) -> bool:
    """Whether the reduction keeps a residual: a gcomp method's trait, or PyTorch's hook's (``TorchHookState``)."""
    return state.method.error_feedback if isinstance(state, gcomp.HookState) else state.error_feedback


def gbps(nbytes: float, seconds: float) -> float:
    """``nbytes`` over ``seconds`` in GB/s (10**9 bytes); NaN for a time too small to measure (0 or less)."""
    return nbytes / seconds / 1e9 if seconds > 0 else math.nan


def floor(name: str, bits_per_entry: float, residual: bool) -> float:
    """The least memory traffic of a codec sending ``bits_per_entry``, in copies of the bucket (module doc)."""
    if name == "identity":
        return 0.0
    return 1.0 + bits_per_entry / 32 + (1.0 if residual else 0.0)


def default_rows() -> list[str]:
    """Every registered method, then the configurations and PyTorch hooks the table holds beside them."""
    return gcomp.available() + list(EXTRA_ROWS)


def run(sizes_mb=(1, 4, 16, 64), methods=None, repeats: int = 3, seed: int = 0, log=None,
        device: str = "cpu") -> list[dict]:
    """One row per method and size. Progress is a bar on a terminal; ``log`` (stderr by default) gets one line
    per failed method and nothing else."""
    log = log or (lambda text: print(text, file=sys.stderr))
    device = table_device(device)
    started = one_rank_group(device)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    names = methods or default_rows()
    bar = Progress(len(sizes_mb) * len(names), "codec")
    try:
        rows = []
        for size in sizes_mb:
            numel = bucket_numel(size)
            for name in names:
                bar.update(f"{name}, {size:g} MB")
                try:
                    rows.append(measure(name, numel, repeats, torch.Generator().manual_seed(seed), device))
                except Exception as err:  # noqa: BLE001 -- one method's failure is its row; the others go on
                    rows.append({"method": name, "device": device.type, "size_mb": numel * 4 / 2**20,
                                 "error": f"{type(err).__name__}: {err}"})
                    log(f"  {name}, {rows[-1]['size_mb']:g} MB: FAILED: {rows[-1]['error']}")
        return rows
    finally:
        bar.close()
        torch.set_num_threads(threads)
        if started:
            codec_hooks.quiesce()
            dist.destroy_process_group()
            codec_hooks.release()


def markdown(rows: list[dict], full: bool = False) -> str:
    """The table at the largest size, within 100 columns (every size is in codec.csv); ``full``: every size's
    columns, as wide as that takes."""
    sizes = sorted({r["size_mb"] for r in rows})
    shown = sizes if full else sizes[-1:]
    last = f"{sizes[-1]:g} MB"
    host = "host " if any(r.get("codec_clock") == "host" for r in rows) else ""
    if full:
        head = (f"| method | bits per entry | floor | peak extra / bucket, {last} | largest allocation / bucket, "
                f"{last} | " + " | ".join(f"{host}encode+decode / copy, {s:g} MB" for s in shown)
                + " | " + " | ".join(f"reduce / copy, {s:g} MB" for s in shown)
                + " | " + " | ".join(f"reduce GB/s, {s:g} MB" for s in shown) + " |")
    else:
        head = (f"| method | bits/entry | floor | peak extra | largest alloc | {host}codec/copy | reduce/copy "
                "| GB/s |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]

    def cell(row, key, digits=".2f"):
        if row is None or "error" in row:
            return "error"
        return "n/a" if math.isnan(row[key]) else f"{row[key]:{digits}}"

    for name in dict.fromkeys(r["method"] for r in rows):
        mine = {r["size_mb"]: r for r in rows if r["method"] == name}
        big = mine.get(sizes[-1])
        lines.append(f"| {name} | {cell(big, 'bits_per_entry', '.3g')} | {cell(big, 'floor')} | "
                     f"{cell(big, 'peak_extra_frac')} | {cell(big, 'largest_alloc_frac')} | "
                     + " | ".join(cell(mine.get(s), "codec_ratio") for s in shown)
                     + " | " + " | ".join(cell(mine.get(s), "reduce_ratio") for s in shown)
                     + " | " + " | ".join(cell(mine.get(s), "reduce_gbps", ".1f") for s in shown) + " |")
    copies = {r["size_mb"]: r["copy_gbps"] for r in rows if "error" not in r}
    if not full:
        lines.append(f"\nat {last} per bucket: memory in buckets, times in copies, GB/s of the reduction")
    lines.append("copy: " + ", ".join(f"{copies[s]:.1f} GB/s at {s:g} MB" for s in sizes if s in copies))
    return "\n".join(lines)
