"""``topk``: the k largest-magnitude entries of each bucket."""
from __future__ import annotations

import torch

from gcomp.compressors.sparse.payload import SparseCompressor, magnitude_keys
from gcomp.core import ALLGATHER, LARGEST, Traits


def top_count(n: int, ratio: float) -> int:
    return max(1, int(n * ratio))


class TopKCompressor(SparseCompressor):
    """Sends the ``k = max(1, int(ratio * n))`` entries of largest magnitude (one torch.topk of the bucket's
    magnitude keys: NaN and infinities rank above every finite magnitude, so a non-finite gradient is always sent) by
    all-gather, entries several ranks chose summed: k values (``values``: the bucket's dtype, or bf16/fp16 16 bits,
    fp8_e4m3 8 bits plus one fp32 scale) and k positions, coded (sorted, the smaller of a bitmap, n bits, and
    Elias-Fano, k L + k + ceil(n / 2**L) bits with L = max(0, floor(log2(n / k))), in whole bytes: about 8.6 bits a
    position at ratio 0.01) or raw (32 bits, 64 past 2**31 entries)."""

    def __init__(self, ratio: float, positions: str = "raw", values: str = "fp32"):
        super().__init__(positions, values)
        self.ratio = ratio
        wire = self.wire
        self.traits = Traits(ALLGATHER, LARGEST, rows=None,
                             wire_bytes=lambda n, world: wire.nbytes(n, top_count(n, ratio)))

    def encode(self, x, state, layout):
        flat = x.reshape(-1)
        index = torch.topk(magnitude_keys(flat), top_count(flat.numel(), self.ratio), sorted=False).indices
        return self.payload(flat, index, flat[index]), state
