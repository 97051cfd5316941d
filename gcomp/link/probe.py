"""The timed probe of a link (``gcomp bench``'s workers and ``auto`` use it): ``timed_allreduce_s`` times
all-reduces on a process group, ``link_from_timings`` derives ``alpha`` from a tiny one and ``beta`` from the
difference of a tiny and a large one.
"""
from __future__ import annotations

import time

# 128 int64: small, yet an entry for every rank's chunk of a ring up to 128 ranks; a one-entry all-reduce
# leaves most chunks empty and read a far lower alpha than the rounds of a run met (8 ranks: 60 us against ~1 ms)
PROBE_SMALL_BYTES = 1024
PROBE_LARGE_BYTES = 1 << 20  # large enough that the bytes, not the messages, dominate at 100 Gbit/s too


def timed_allreduce_s(nbytes: int, repeats: int, group, device, warmup: bool = True) -> float:
    """The fastest of ``repeats`` all-reduces of ``nbytes`` on this rank, every rank starting together: what the
    path itself takes (other work on the machine only ever adds to it). ``warmup``: one untimed all-reduce
    first (connections, buffers); a running job whose training opened them needs none."""
    import torch
    import torch.distributed as dist

    tensor = torch.zeros(max(nbytes // 8, 1), dtype=torch.int64, device=device)
    if warmup:
        dist.all_reduce(tensor, group=group)
    samples = []
    for _ in range(repeats):
        dist.barrier(group=group)
        start = time.perf_counter()
        dist.all_reduce(tensor, group=group)
        if tensor.device.type == "cuda":
            torch.cuda.synchronize(tensor.device)
        samples.append(time.perf_counter() - start)
    return min(samples)


def link_from_timings(small_s: float, large_s: float, workers: int, small_bytes: int = PROBE_SMALL_BYTES,
                      large_bytes: int = PROBE_LARGE_BYTES) -> dict:
    """``alpha_s`` (seconds per message) and ``beta_s`` (seconds per byte) from the times of two ring all-reduces
    of ``small_bytes`` and ``large_bytes`` over ``workers`` ranks (``2(P-1)`` messages, ``2(P-1)/P * n`` bytes
    per rank each); with one worker there is no link (both None)."""
    if workers < 2:
        return {"alpha_s": None, "beta_s": None}
    share = 2 * (workers - 1) / workers
    beta = max(large_s - small_s, 0.0) / (share * (large_bytes - small_bytes))
    alpha = max(small_s - share * small_bytes * beta, 0.0) / (2 * (workers - 1))
    return {"alpha_s": alpha, "beta_s": beta}
