"""``topk``: the k largest-magnitude entries of each bucket, with error feedback, by all-gather."""
from __future__ import annotations

from typing import Annotated

import torch

from gcomp.collectives import AllgatherCommunicator
from gcomp.core import ALLGATHER, Compressor, Method, Payload
from gcomp.memory import ResidualMemory
from gcomp.params import Range
from gcomp.registry import register

_INT32_LIMIT = 2**31 - 1


class TopKCompressor(Compressor):
    """Sends the ``k = max(1, int(ratio * n))`` entries of largest magnitude: k values in the bucket's dtype
    and k int32 positions (int64 past 2**31 elements), by all-gather. Entries several ranks chose are summed.

    NaN and infinities rank above every finite magnitude, so a non-finite gradient is always sent.
    """

    collective = ALLGATHER

    def __init__(self, ratio: float):
        self.ratio = ratio

    def compress(self, tensor, bucket):
        n = tensor.numel()
        k = max(1, int(n * self.ratio))
        _, index = torch.topk(tensor.abs(), k, sorted=False)
        values = tensor[index]
        index = index.to(torch.int32) if n <= _INT32_LIMIT else index
        return Payload([values, index], ctx=(n, tensor.dtype))

    def decompress(self, tensors, ctx):
        values, index = tensors
        n, dtype = ctx
        return torch.zeros(n, dtype=dtype, device=values.device).index_add_(0, index, values)

    def aggregate(self, gathered, ctx):
        values, index = gathered
        return self.decompress([values.reshape(-1), index.reshape(-1)], ctx)


@register("topk", paper="Aji & Heafield 2017 (gradient dropping); Stich et al. 2018 (error feedback)")
def topk(ratio: Annotated[float, Range(0, 1, low_open=True), "fraction of the bucket's entries sent"] = 0.01
         ) -> Method:
    """Top-k sparsification with error feedback: the largest entries go by all-gather, the rest wait."""
    return Method(TopKCompressor(ratio), ResidualMemory(), AllgatherCommunicator())
