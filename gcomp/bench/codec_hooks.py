"""PyTorch's own PowerSGD hook as a row of ``gcomp bench --codec``: read as the table reads a gcomp hook state.

Its callbacks run on gloo's threads and close over the process group; gcomp cannot settle them as it settles its
own. Were one of those threads to drop the last reference to a group already destroyed, the group's destructor
would join that very thread ("Resource deadlock avoided", the process aborted: seen in the suite). So the hook
states are kept alive until the group is gone (``release``), and the table gives the threads a moment to finish
their callbacks before it destroys the group (``quiesce``)."""
from __future__ import annotations

import gc
import math
import time

import torch

_KEPT: list = []  # every TorchHookState made, until ``release``

from gcomp.bench.methods import POWERSGD_RANK, _powersgd_bytes


class TorchHookState:
    """``powerSGD_hook`` (rank ``POWERSGD_RANK``, compressing from its third call) with the ``stats`` a
    ``HookState`` keeps that the codec table reads: bucket calls and bytes handed to collectives; its encode and
    decode are not timed apart (NaN)."""

    error_feedback = True  # PowerSGD's error, kept per bucket

    def __init__(self, name: str, ddp: torch.nn.Module):
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
        if name != "torch:powersgd":
            raise ValueError(f"gcomp bench --codec: of PyTorch's hooks it times torch:powersgd; got {name!r}")
        self.hook = powerSGD_hook.powerSGD_hook
        self.state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=POWERSGD_RANK,
                                                 start_powerSGD_iter=2, random_seed=0)
        self.stats = {"buckets": 0, "bytes_sent": 0, "encode_s": math.nan, "decode_s": math.nan}
        self.futures: list = []  # every reduction's future, kept with the state
        _KEPT.append(self)

    def reduce(self, bucket) -> torch.futures.Future:
        self.stats["buckets"] += 1
        self.stats["bytes_sent"] += _powersgd_bytes(bucket, self.state)
        future = self.hook(self.state, bucket)
        self.futures.append(future)
        return future


def quiesce() -> None:
    """Before the group is destroyed: let gloo's threads finish the callbacks of PyTorch's hooks, and collect."""
    if _KEPT:
        time.sleep(0.25)
        gc.collect()


def release() -> None:
    """After the group is destroyed: drop the hook states, here on the main thread."""
    _KEPT.clear()
    gc.collect()
