"""How long rank 0 waits, each step, for its slowest peer to be ready to communicate: measured in the run.

A collective starts when the last rank reaches it, so a rank's step holds its own local work, the wait for the
slowest peer, and the communication itself. On the benchmark's machine the wait is mostly processes waiting
for a core (several workers share few cores, and other work runs beside them); a cluster with a node per
worker sees little of it. ``gcomp simulate`` adds the measured wait to the step it checks against a run, so
that the error it reports is the error of the communication model, and leaves it out of its projection.

``ReadyClock`` wraps a hook state's ``reduce``: a rank is ready when its step's last bucket reaches the hook
and its encoding is done (the bucket's host time in ``encode_s``). The workers of a benchmark run on one
machine, where ``time.perf_counter`` is the same clock in every process (``CLOCK_MONOTONIC`` on Linux), so
the ranks' ready times compare directly.
"""
from __future__ import annotations

import statistics
import time

import torch.distributed as dist


class ReadyClock:
    """Records, per step, when this rank was ready to communicate its last bucket (``ready``: one
    ``time.perf_counter()`` value per step). With ``state`` None (a hook that is not gcomp's) nothing is
    recorded."""

    def __init__(self, state=None):
        self.ready: list[float] = []
        if state is None:
            return
        reduce, stats = state.reduce, state.stats

        def timed(bucket):
            start, encoded = time.perf_counter(), stats["encode_s"]
            future = reduce(bucket)
            if bucket.is_last():
                self.ready.append(start + stats["encode_s"] - encoded)
            return future

        state.reduce = timed


def waits(ready_by_rank: list[list[float]]) -> list[float]:
    """Per step, how long rank 0 waited for the last rank to be ready (0 when it was the last itself)."""
    steps = min((len(r) for r in ready_by_rank), default=0)
    return [max(r[s] for r in ready_by_rank) - ready_by_rank[0][s] for s in range(steps)]


def wait_for_peers(clock: ReadyClock, first_step: int, group=None) -> float | None:
    """Mean over the steps from ``first_step`` of rank 0's wait for its slowest peer (every rank calls this
    together: the ready times are gathered); None when no ready time was recorded."""
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, clock.ready, group=group)
    per_step = waits(gathered)[first_step:]
    return statistics.mean(per_step) if per_step else None
