"""``auto``'s own collectives: the ranks agreeing on what they measured, and the timed probe of the link."""
from __future__ import annotations

import torch
import torch.distributed as dist

from gcomp.auto.choice import link_network
from gcomp.link import Network, link_from_timings, timed_allreduce_s

PROBE_SMALL_BYTES = 1024
# the large probe: the largest bucket, within these bounds (at 100 Mbit/s on 4 ranks 512 KiB takes about 63 ms, so
# the bytes still dominate its time at 1 Gbit/s while a probe costs a few steps' worth on slow links)
PROBE_LARGE_BYTES = (128 * 1024, 512 * 1024)
PROBE_REPEATS = (2, 1)  # small, large: the fastest of this many (no warm-up: training already opened the links)


def agree_max(values: list[float], group, device: torch.device) -> list[float]:
    """The element-wise MAX of ``values`` over the ranks of ``group`` (one all-reduce, waited for): every rank
    then decides from the same numbers, the slowest rank's."""
    return launch_max(values, group, device).values()


class Pending:
    """A MAX all-reduce launched and not waited for; ``values`` waits (long done when read a step later)."""

    def __init__(self, work, tensor: torch.Tensor):
        self.work, self.tensor = work, tensor

    def values(self) -> list[float]:
        if self.work is not None:
            self.work.wait()
        return self.tensor.cpu().tolist()


def launch_max(values: list[float], group, device: torch.device) -> Pending:
    """``agree_max`` launched asynchronously: it runs beside the buckets' collectives instead of stopping the
    backward pass for a round trip."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    return Pending(dist.all_reduce(tensor, dist.ReduceOp.MAX, group=group, async_op=True), tensor)


def probe_network(group, device: torch.device, bucket_bytes: int = 0) -> Network:
    """The link as ``auto`` prices it: timed all-reduces of 1 KiB and of the largest bucket's bytes (within
    ``PROBE_LARGE_BYTES``), α and β derived as ``gcomp.link.link_from_timings`` does, the slowest
    rank's agreed by all."""
    low, high = PROBE_LARGE_BYTES
    large = min(max(int(bucket_bytes), low), high)
    small_s = timed_allreduce_s(PROBE_SMALL_BYTES, PROBE_REPEATS[0], group, device, warmup=False)
    large_s = timed_allreduce_s(large, PROBE_REPEATS[1], group, device, warmup=False)
    link = link_from_timings(small_s, large_s, dist.get_world_size(group), PROBE_SMALL_BYTES, large)
    alpha_s, beta_s = agree_max([link["alpha_s"] or 0.0, link["beta_s"] or 0.0], group, device)
    return link_network(alpha_s, beta_s)
