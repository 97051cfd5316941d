"""``threshold``: every entry whose magnitude passes a fixed threshold, with error feedback, by sized all-gather."""
from __future__ import annotations

from typing import Annotated

import torch
import torch.distributed as dist

from gcomp.bucket import index_dtype
from gcomp.collectives.allgather_sized import SizedAllgatherCommunicator
from gcomp.compressors.sparse import SparseCompressor, magnitude_keys, positions_at_least
from gcomp.memory import ResidualMemory
from gcomp.method import Method
from gcomp.params import Range
from gcomp.registry import register

_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _floor_to(value: float, dtype: torch.dtype) -> float:
    """The largest finite ``dtype`` value <= ``value`` (>= 0): comparing a ``dtype`` tensor with it is exact, where
    comparing with ``value`` itself would round ``value`` to the nearest ``dtype`` value first, up or down."""
    exact = torch.tensor(value, dtype=torch.float64)
    rounded = exact.to(dtype).clamp(max=torch.finfo(dtype).max)
    if rounded.double() > exact:  # positive floats: the bit pattern minus one is the next value down
        bits = _BITS[rounded.element_size()]
        rounded = (rounded.view(bits) - 1).view(dtype)
    return float(rounded)


class ThresholdCompressor(SparseCompressor):
    """Sends the entries whose local magnitude exceeds ``threshold``: their values in the bucket's dtype and
    int32 positions (int64 past 2**31 elements), as many as there are, so the count differs per rank and step.
    On the wire (``SizedAllgatherCommunicator``): one int64 size per rank, then values and positions
    zero-padded to the largest count, by all-gather. Entries several ranks chose are summed.

    The threshold is on the local gradient: the hook hands over ``g / world``, so that is compared with
    ``threshold / world``. NaN and infinities always pass. The entries are found in one chunked pass over the
    bucket (``positions_at_least``) with no bucket-sized mask or magnitude tensor.
    """

    def __init__(self, threshold: float):
        self.threshold = threshold
        self.world_size = 1
        self._floors: dict[torch.dtype, torch.Tensor] = {}

    def bind(self, model, group, stats) -> None:
        self._floors.clear()
        if dist.is_available() and dist.is_initialized():
            self.world_size = dist.get_world_size(group)

    def compress(self, tensor, bucket):
        floor = self._floors.get(tensor.dtype)
        if floor is None:  # as a magnitude key, above which NaN and infinities lie too: they are always sent
            floor = self._floors[tensor.dtype] = magnitude_keys(torch.tensor(
                _floor_to(self.threshold / self.world_size, tensor.dtype), dtype=tensor.dtype))
        flat = tensor.reshape(-1)
        # the count decides the payload's size: a host sync is inherent
        index = positions_at_least(flat, floor.to(tensor.device), index_dtype(flat.numel()), strict=True)
        return self.sparse_payload(flat[index], index, tensor, bucket)


@register("threshold", paper="Strom 2015 (Scalable distributed DNN training using commodity GPU cloud computing)")
def threshold(threshold: Annotated[float, Range(0, None), "send entries of the local gradient with |g| above this"]
              = 0.01) -> Method:
    """Threshold sparsification with error feedback: a variable count per rank, sizes exchanged, then all-gather."""
    return Method(ThresholdCompressor(threshold), ResidualMemory(), SizedAllgatherCommunicator())
