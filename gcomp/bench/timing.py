"""Timing operations side by side on a shared, noisy machine: interleaved samples, medians.

The clock is pluggable: a host clock function (``time.perf_counter``, ``time.process_time``) or an object with
``start()`` and ``stop(token) -> seconds``, such as ``CudaEventClock``, which times what a GPU ran.
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Callable, Protocol

TARGET_S = 0.02  # each timed sample repeats its operation until it lasts about this long


class Clock(Protocol):
    def start(self) -> object:
        """Mark the beginning of a sample; what it returns goes to ``stop``."""

    def stop(self, begin: object) -> float:
        """Seconds since ``begin``."""


class HostClock:
    """Seconds between two readings of a host clock function."""

    def __init__(self, read: Callable[[], float] = time.perf_counter):
        self.read = read

    def start(self) -> float:
        return self.read()

    def stop(self, begin: float) -> float:
        return self.read() - begin


class CudaEventClock:
    """Seconds the GPU spent between two CUDA events on the current stream.

    ``start`` waits until the device is idle (so no earlier work lands in the sample) and records an event;
    ``stop`` records another and waits for it. Kernels are launched asynchronously: a host clock read after a
    launch measures the launch, not the work. ``event`` and ``synchronize`` are for tests (fakes).
    """

    def __init__(self, event: Callable[[], object] | None = None, synchronize: Callable[[], None] | None = None):
        import torch
        self.event = event or (lambda: torch.cuda.Event(enable_timing=True))
        self.synchronize = synchronize or torch.cuda.synchronize

    def start(self) -> object:
        self.synchronize()
        begin = self.event()
        begin.record()
        return begin

    def stop(self, begin) -> float:
        end = self.event()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3  # elapsed_time is in milliseconds


def as_clock(clock: Clock | Callable[[], float]) -> Clock:
    """A ``Clock``; a plain function is read as a host clock."""
    return clock if hasattr(clock, "start") and hasattr(clock, "stop") else HostClock(clock)


def _timed(fn: Callable[[], object], inner: int, clock: Clock) -> float:
    begin = clock.start()
    for _ in range(inner):
        fn()
    return clock.stop(begin) / inner


def median_times(ops: dict[str, Callable[[], object]], repeats: int,
                 clock: Clock | Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Median seconds per call of each operation, the operations interleaved within every repeat."""
    clock = as_clock(clock)
    inner = {}
    for name, fn in ops.items():  # warm up, then size each sample to about TARGET_S
        fn()
        inner[name] = max(1, min(1000, math.ceil(TARGET_S / max(_timed(fn, 1, clock), 1e-9))))
    names, samples = list(ops), {name: [] for name in ops}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            samples[name].append(_timed(ops[name], inner[name], clock))
    return {name: statistics.median(s) for name, s in samples.items()}
