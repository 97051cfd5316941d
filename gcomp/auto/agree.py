"""``auto``'s own collectives: the ranks agreeing on what they measured, and the timed probe of the link."""
from __future__ import annotations

import torch
import torch.distributed as dist

from gcomp.auto.choice import link_network
from gcomp.bench.collective_costs import Network
from gcomp.bench.throughput import probe_link

PROBE_SMALL_BYTES = 1024
# the large probe: the largest bucket, within these bounds (at 100 Mbit/s on 4 ranks 1 MiB takes about 125 ms, so
# the bytes dominate its time on fast links too while a probe stays a few steps' worth on slow ones)
PROBE_LARGE_BYTES = (256 * 1024, 1024 * 1024)
PROBE_REPEATS = (3, 1)  # the fastest of this many, each after one untimed warm-up


def comm_device(group, like: torch.device) -> torch.device:
    """Where tensors for ``group``'s collectives live: NCCL reduces CUDA tensors only."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return like if like.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree_max(values: list[float], group, device: torch.device) -> list[float]:
    """The element-wise MAX of ``values`` over the ranks of ``group`` (one all-reduce, waited for): every rank
    then decides from the same numbers, the slowest rank's."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, dist.ReduceOp.MAX, group=group)
    return tensor.cpu().tolist()


def probe_network(group, device: torch.device, bucket_bytes: int = 0) -> Network:
    """The link as ``auto`` prices it: timed all-reduces of 1 KiB and of the largest bucket's bytes (within
    ``PROBE_LARGE_BYTES``) by ``probe_link``, the slowest rank's latency and seconds per byte agreed by all."""
    low, high = PROBE_LARGE_BYTES
    large = min(max(int(bucket_bytes), low), high)
    link = probe_link(group, PROBE_SMALL_BYTES, large, PROBE_REPEATS, device)
    alpha_s, beta_s = agree_max([link["alpha_s"] or 0.0, link["beta_s"] or 0.0], group, device)
    return link_network(alpha_s, beta_s)
