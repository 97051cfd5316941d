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
after their tracker froze the support; every other method on a dense random bucket. Times are wall-clock
medians, operations interleaved within every repeat (``gcomp.bench.timing.median_times``).
"""
from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import prune as torch_prune

import gcomp
from gcomp.bench.timing import median_times
from gcomp.bench.runner import free_port

ROW_WIDTH = 256  # the pruned buckets are (numel / 256, 256) weights
FROZEN_AFTER = 4  # reductions before timing: pactrain/prunex (stable_steps=1) have frozen by then


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


def _holder(name: str, numel: int, generator: torch.Generator) -> nn.Module:
    layer = nn.Linear(ROW_WIDTH, numel // ROW_WIDTH, bias=False)
    if name == "pactrain":
        mask = (torch.rand(layer.weight.shape, generator=generator) >= 0.5).float()
        torch_prune.custom_from_mask(layer, "weight", mask)
    elif name == "prunex":
        rows = (torch.rand(layer.weight.shape[0], generator=generator) >= 0.5).float()
        torch_prune.custom_from_mask(layer, "weight", rows[:, None].expand_as(layer.weight).contiguous())
    return layer


def _one_rank_group() -> bool:
    """Start a one-rank gloo group unless one is running; True when this call started it."""
    if dist.is_initialized():
        return False
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=120))
    return True


def measure(name: str, numel: int, repeats: int, generator: torch.Generator) -> dict:
    model = _holder(name, numel, generator)
    param = next(model.parameters())
    ddp = nn.parallel.DistributedDataParallel(model)
    params = {"stable_steps": 1} if name in ("pactrain", "prunex") else {}
    state = gcomp.HookState(gcomp.create(name, **params), ddp, None)
    state.warmup = 0
    source = torch.randn(numel, generator=generator)
    if name == "pactrain":
        source.mul_(model.weight_mask.reshape(-1))
    buffer, dst = torch.empty_like(source), torch.empty_like(source)

    def reduce():
        buffer.copy_(source)
        return state.reduce(_Bucket(buffer, param)).wait()

    for _ in range(FROZEN_AFTER):
        reduce()
    before = dict(state.stats)
    times = median_times({"copy": lambda: dst.copy_(source), "reduce": reduce}, repeats, time.perf_counter)
    calls = state.stats["buckets"] - before["buckets"]
    codec = (state.stats["encode_s"] + state.stats["decode_s"] - before["encode_s"] - before["decode_s"]) / calls
    sent = (state.stats["bytes_sent"] - before["bytes_sent"]) / calls
    copy_s = times["copy"]
    bits = 8 * sent / numel
    return {"method": name, "size_mb": numel * 4 / 2**20, "copy_s": copy_s, "codec_s": codec,
            "codec_ratio": codec / copy_s, "reduce_s": times["reduce"] - copy_s,  # less the refill of the bucket
            "reduce_ratio": (times["reduce"] - copy_s) / copy_s, "bits_per_entry": bits,
            "floor": floor(name, bits, state.method.memory.stateful)}


def floor(name: str, bits_per_entry: float, residual: bool) -> float:
    """The least memory traffic of a codec sending ``bits_per_entry``, in copies of the bucket (module doc)."""
    if name == "identity":
        return 0.0
    return 1.0 + bits_per_entry / 32 + (1.0 if residual else 0.0)


def run(sizes_mb=(1, 4, 16, 64), methods=None, repeats: int = 3, seed: int = 0, log=print) -> list[dict]:
    started = _one_rank_group()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = []
        for size in sizes_mb:
            numel = max(ROW_WIDTH, int(size * 2**20) // 4 // ROW_WIDTH * ROW_WIDTH)
            for name in methods or gcomp.available():
                rows.append(measure(name, numel, repeats, torch.Generator().manual_seed(seed)))
                log(f"  {name}, {rows[-1]['size_mb']:g} MB: encode+decode {rows[-1]['codec_ratio']:.2f}x copy, "
                    f"reduce {rows[-1]['reduce_ratio']:.2f}x copy")
        return rows
    finally:
        torch.set_num_threads(threads)
        if started:
            dist.destroy_process_group()


def markdown(rows: list[dict]) -> str:
    sizes = sorted({r["size_mb"] for r in rows})
    head = ("| method | bits per entry | floor | " + " | ".join(f"encode+decode / copy, {s:g} MB" for s in sizes)
            + " | " + " | ".join(f"reduce / copy, {s:g} MB" for s in sizes) + " |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for name in dict.fromkeys(r["method"] for r in rows):
        mine = {r["size_mb"]: r for r in rows if r["method"] == name}
        bits, least = mine[sizes[-1]]["bits_per_entry"], mine[sizes[-1]]["floor"]
        lines.append(f"| {name} | {bits:.3g} | {least:.2f} | "
                     + " | ".join(f"{mine[s]['codec_ratio']:.2f}" for s in sizes)
                     + " | " + " | ".join(f"{mine[s]['reduce_ratio']:.2f}" for s in sizes) + " |")
    return "\n".join(lines)
