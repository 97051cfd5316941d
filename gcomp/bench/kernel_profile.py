"""What one method's bucket reduction spends its time on: ``python -m gcomp.bench.kernel_profile``.

The reduction of ``gcomp bench --codec`` (``codec_table.reducer``: one fp32 bucket on a one-rank group), run
``--repeats`` times under ``torch.profiler``. Printed per method: the wall time per reduction, the device
time its kernels and copies took (CUDA only), their ratio (``busy``; far below 1 means the host, not the
device, sets the pace: a CPU generator, a synchronisation, many small launches), and the rows that took the
most time on the device (CUDA: an operator's row and its kernel's row show the same time) or the host (CPU),
per reduction.
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from gcomp.bench import codec_table
from gcomp.bench.quiet import held_back_profiler_lines
from gcomp.registry import available


def _top(events, key: str, count: int, repeats: int) -> list[tuple[str, float, int]]:
    rows = sorted(((e.key, getattr(e, key) / repeats, e.count // repeats) for e in events
                   if getattr(e, key) > 0), key=lambda r: -r[1])
    return rows[:count]


def profile_method(name: str, numel: int, repeats: int, device: str, top: int = 6) -> dict:
    """The profile of ``repeats`` reductions of method ``name``: times per reduction, in microseconds."""
    cuda = torch.device(device).type == "cuda"
    _, reduce, _ = codec_table.reducer(name, numel, torch.Generator().manual_seed(0), device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync()
    with held_back_profiler_lines(), profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(repeats):
            reduce()
        sync()
        wall = (time.perf_counter() - start) / repeats
    events = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    # an operator's self device time is its kernels' time again: only the kernels' and copies' own rows count
    device_us = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA) / repeats \
        if cuda else float("nan")
    return {"method": name, "wall_us": wall * 1e6, "device_us": device_us, "busy": device_us / (wall * 1e6),
            "top": _top(events, key, top, repeats)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gcomp.bench.kernel_profile", description=__doc__.split("\n")[0])
    parser.add_argument("--method", nargs="+", default=None, help="methods (default: every registered one)")
    parser.add_argument("--size-mb", type=float, default=64.0, help="fp32 bucket size (default 64)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    numel = codec_table.bucket_numel(args.size_mb)
    device = codec_table.table_device(args.device)
    started = codec_table.one_rank_group(device)
    try:
        for name in args.method or available():
            try:
                r = profile_method(name, numel, args.repeats, device)
            except Exception as err:  # noqa: BLE001 -- one method's failure is reported, the others go on
                print(f"{name}: FAILED: {type(err).__name__}: {err}")
                continue
            print(f"{name}: {r['wall_us']:.0f} us per reduction, device {r['device_us']:.0f} us, "
                  f"busy {r['busy']:.2f}")
            for op, us, count in r["top"]:
                print(f"    {us:9.1f} us  x{count:<3d} {op[:90]}")
    finally:
        if started:
            torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
