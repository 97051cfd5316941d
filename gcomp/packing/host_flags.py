"""Flags a step receives, on their way to the host, to be read at the next step: the per-step path never waits
on a collective's result (on a GPU an asynchronous copy into pinned memory, behind an event)."""
from __future__ import annotations

import torch


def host_flag(flags: torch.Tensor) -> tuple:
    """``flags`` on their way to the host (``read_host_flag`` reads them): on a GPU an asynchronous copy into
    pinned memory with an event to wait on, so that the step that receives them never waits on it."""
    if flags.device.type != "cuda":
        return flags, None
    host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
    host.copy_(flags, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return host, copied


def read_host_flag(pending: tuple) -> torch.Tensor:
    """The host copy of what ``host_flag`` sent, once its copy is done (waits for that one copy, not for the
    current stream)."""
    host, copied = pending
    if copied is not None:
        copied.synchronize()
    return host
