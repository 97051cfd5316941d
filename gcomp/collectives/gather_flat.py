"""The one all-gather into a flat tensor, by whichever name the installed torch gives it."""
from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_flat(out: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup | None = None,
                    async_op: bool = False):
    """Every rank's ``tensor`` concatenated into ``out`` (``world * tensor.numel()`` entries).

    torch 2.13 names this collective ``all_gather_single`` and deprecates ``all_gather_into_tensor``, the
    only name up to 2.12 (found missing on torch 2.11 with CUDA): the name is looked up per call, so the
    project's ``torch>=2.4`` holds and a test may wrap either.
    """
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, tensor, group=group, async_op=async_op)
