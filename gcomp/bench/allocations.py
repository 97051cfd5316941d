"""What one call allocates: its peak extra bytes and its largest single allocation, on CPU or on a CUDA device.

- peak extra bytes: the most bytes the call holds allocated at once beyond what was allocated when it began.
  On CPU from the profiler's allocation events, summed in order: the profiler does not see the release of a
  block allocated before it started, so a tensor swapped for a new one of its size counts in full (an upper
  bound); on CUDA from ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` (the caching
  allocator's blocks, so sizes rounded up to 512 bytes), less what was allocated before.
- largest single allocation: the largest of the profiler's allocation events on that device.

Allocations made outside PyTorch's allocators (a collective backend's own buffers) are not seen. NaN where this
PyTorch's profiler does not expose its raw events (not a documented API), or, on CUDA, where it recorded none
for a call that did allocate.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from gcomp.bench.quiet import held_back_profiler_lines


@dataclass
class Allocations:
    peak_extra_bytes: float
    largest_bytes: float


def _memory_events(prof, device_type: str) -> list | None:
    """The profiler's allocation (+) and free (-) events on ``device_type``, in order; None if not exposed."""
    try:
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        mine = [e for e in events if e.device_type().name.lower() == device_type]
    except AttributeError:
        return None
    return sorted(mine, key=lambda e: e.start_ns())


def _peak_of(events) -> float:
    held = peak = 0
    for e in events:
        held += e.nbytes()
        peak = max(peak, held)
    return float(peak)


def measure_allocations(fn: Callable[[], object], device: torch.device | str = "cpu") -> Allocations:
    """Run ``fn`` once and report what it allocated on ``device`` (module doc)."""
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    with held_back_profiler_lines(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize(device)
    events = _memory_events(prof, device.type)
    largest = math.nan if events is None else float(max([e.nbytes() for e in events] + [0]))
    if not cuda:
        return Allocations(math.nan if events is None else _peak_of(events), largest)
    peak = float(torch.cuda.max_memory_allocated(device) - before)
    if peak > 0 and not events:
        largest = math.nan  # it allocated, but the profiler saw none of it
    return Allocations(peak, largest)


def peak_extra_bytes(fn: Callable[[], object]) -> float:
    """The most bytes ``fn`` holds allocated at once on the CPU beyond what it started with."""
    return measure_allocations(fn, "cpu").peak_extra_bytes
