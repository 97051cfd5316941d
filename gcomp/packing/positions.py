"""The device path of a support's gather and scatter (``gcomp.kernels.on_device``): one int32 index of every kept
position, in packed order, so that packing a bucket is one ``index_select`` and unpacking one ``zero_`` and one
``index_add_``, whatever the number of parameters, runs, filters or channels.

The index is built once per frozen support, at its first device-path call (a host synchronisation then, never
per step) and costs 4 bytes per kept entry: half an fp32 bucket when half is kept. The CPU path's slices and
groups stay as they are (faster on one thread, and with less index memory).
"""
from __future__ import annotations

import torch

from gcomp.bucket import INT32_LIMIT

# index_add_ onto zeros is a copy that takes int32 positions (index_copy_ wants int64); adding the bits as
# integers of the same width is exact, and keeps a negative zero's sign (0.0 + -0.0 is +0.0)
_SAME_WIDTH_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def kept_positions(gather, numel: int, kept: int, device) -> torch.Tensor:
    """The int32 positions of the kept entries in packed order, from a support's own ``gather`` (the CPU path's):
    it packs an ``arange`` of the bucket's positions."""
    if numel > INT32_LIMIT:
        raise ValueError(f"a bucket of {numel} entries is too large for int32 positions")
    out = torch.empty(kept, dtype=torch.int32, device=device)
    return gather(torch.arange(numel, dtype=torch.int32, device=device), out)


def gather_at(positions: torch.Tensor, bucket: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[:kept]`` = ``bucket`` at ``positions``; returns ``out``."""
    torch.index_select(bucket, 0, positions, out=out[:positions.numel()])
    return out


def scatter_at(positions: torch.Tensor, packed: torch.Tensor, bucket: torch.Tensor) -> torch.Tensor:
    """``bucket`` = zero, with ``packed[:kept]`` at ``positions``; returns ``bucket``."""
    ints = _SAME_WIDTH_INT.get(bucket.element_size())
    values = packed[:positions.numel()]
    if ints is None or packed.dtype != bucket.dtype:
        return bucket.zero_().index_copy_(0, positions.long(), values)
    bucket.view(ints).zero_().index_add_(0, positions, values.view(ints))
    return bucket
