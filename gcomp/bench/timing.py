"""Timing operations side by side on a shared, noisy machine: interleaved samples, medians."""
from __future__ import annotations

import math
import statistics
import time
from typing import Callable

TARGET_S = 0.02  # each timed sample repeats its operation until it lasts about this long


def _timed(fn: Callable[[], object], inner: int, clock: Callable[[], float]) -> float:
    begin = clock()
    for _ in range(inner):
        fn()
    return (clock() - begin) / inner


def median_times(ops: dict[str, Callable[[], object]], repeats: int,
                 clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Median seconds per call of each operation, the operations interleaved within every repeat."""
    inner = {}
    for name, fn in ops.items():  # warm up, then size each sample to about TARGET_S
        fn()
        inner[name] = max(1, min(1000, math.ceil(TARGET_S / max(_timed(fn, 1, clock), 1e-9))))
    names, samples = list(ops), {name: [] for name in ops}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            samples[name].append(_timed(ops[name], inner[name], clock))
    return {name: statistics.median(s) for name, s in samples.items()}
