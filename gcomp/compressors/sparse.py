"""The value + position codec that top-k, threshold and DGC share: what differs is which entries they pick."""
from __future__ import annotations

import torch

from gcomp.bucket import index_dtype
from gcomp.core import ALLGATHER, Compressor, Payload


class SparseCompressor(Compressor):
    """Sends chosen entries as values (the bucket's dtype) and positions (int32; int64 past 2**31 entries), by
    all-gather. Subclasses pick the entries in ``compress`` and return ``sparse_payload``; entries several
    ranks sent are summed, and a zero value at position 0 (padding) adds nothing.
    """

    collective = ALLGATHER

    @staticmethod
    def sparse_payload(values: torch.Tensor, index: torch.Tensor, like: torch.Tensor) -> Payload:
        """``values`` at int64 positions ``index`` of a bucket shaped like ``like``."""
        n = like.numel()
        index = index.to(index_dtype(n))
        return Payload([values, index], ctx=(n, like.dtype))

    def decompress(self, tensors, ctx):
        values, index = tensors
        n, dtype = ctx
        return torch.zeros(n, dtype=dtype, device=values.device).index_add_(0, index, values)

    def aggregate(self, gathered, ctx):
        values, index = gathered
        return self.decompress([values.reshape(-1), index.reshape(-1)], ctx)
