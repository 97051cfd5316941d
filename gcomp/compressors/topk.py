"""``topk``: the k largest-magnitude entries of each bucket, with error feedback, by all-gather."""
from __future__ import annotations

from typing import Annotated

import torch

from gcomp.collectives import AllgatherCommunicator
from gcomp.compressors.sparse import SparseCompressor
from gcomp.core import Method
from gcomp.memory import ResidualMemory
from gcomp.params import Range
from gcomp.registry import register


class TopKCompressor(SparseCompressor):
    """Sends the ``k = max(1, int(ratio * n))`` entries of largest magnitude: k values in the bucket's dtype
    and k int32 positions (int64 past 2**31 elements), by all-gather. Entries several ranks chose are summed.

    NaN and infinities rank above every finite magnitude, so a non-finite gradient is always sent.
    """

    def __init__(self, ratio: float):
        self.ratio = ratio

    def compress(self, tensor, bucket):
        n = tensor.numel()
        k = max(1, int(n * self.ratio))
        _, index = torch.topk(tensor.abs(), k, sorted=False)
        return self.sparse_payload(tensor[index], index, tensor)


@register("topk", paper="Aji & Heafield 2017 (gradient dropping); Stich et al. 2018 (error feedback)")
def topk(ratio: Annotated[float, Range(0, 1, low_open=True), "fraction of the bucket's entries sent"] = 0.01
         ) -> Method:
    """Top-k sparsification with error feedback: the largest entries go by all-gather, the rest wait."""
    return Method(TopKCompressor(ratio), ResidualMemory(), AllgatherCommunicator())
