"""PyTorch's own PowerSGD hook as a row of ``gcomp bench --codec``: read as the table reads a gcomp hook state."""
from __future__ import annotations

import math

import torch

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

    def reduce(self, bucket) -> torch.futures.Future:
        self.stats["buckets"] += 1
        self.stats["bytes_sent"] += _powersgd_bytes(bucket, self.state)
        return self.hook(self.state, bucket)
