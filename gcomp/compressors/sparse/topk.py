"""``topk``: the k largest-magnitude entries of each bucket; and the values-at-positions codec by all-gather it shares
with ``threshold`` and ``dgc`` (they differ in which entries they pick)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gcomp.collectives.sparse_wire import SparseWire
from gcomp.core import ALLGATHER, Compressor, Payload, Traits

_KEYS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def magnitude_keys(x: torch.Tensor) -> torch.Tensor:
    """Integers that order like ``|x|``, NaN above infinity (a float's bits less its sign bit), in the signed integer
    dtype of ``x``'s width: no float compare, no special case for NaN."""
    ints = x.view(_KEYS[x.element_size()])
    return torch.bitwise_and(ints, torch.iinfo(ints.dtype).max)


@dataclass
class SparseCtx:
    """A payload's bucket, ``n`` entries of ``dtype``, and the ``k`` entries it sends."""

    n: int
    dtype: torch.dtype
    k: int


class SparseCompressor(Compressor):
    """Chosen entries as values and positions (``gcomp.collectives.sparse_wire``: ``positions`` coded or raw,
    ``values`` fp32, bf16, fp16 or fp8_e4m3) by all-gather. ``decode`` adds every rank's entries into one bucket, so
    entries several ranks sent are summed and a zero value (padding) adds nothing."""

    def __init__(self, positions: str, values: str):
        self.wire = SparseWire(positions, values)

    def payload(self, flat: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> Payload:
        """The payload of ``values`` at the distinct positions ``index`` of ``flat``; its residual is ``flat`` with
        each sent entry replaced by what rounding left of it."""
        tensors, index, values, sent = self.wire.encode(index[None], values[None], flat.numel())
        residual = flat.index_put((index.view(-1),), (values - sent).view(-1))
        return Payload(tensors, SparseCtx(flat.numel(), flat.dtype, index.numel()), residual=residual)

    def decode(self, received, ctx: SparseCtx) -> torch.Tensor:
        index, values = self.wire.decode(received, ctx.n, ctx.k, ctx.dtype)
        out = torch.zeros(ctx.n, dtype=ctx.dtype, device=values.device)
        return out.index_add_(0, index.reshape(-1), values.reshape(-1))


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
        self.traits = Traits(ALLGATHER, wire.fidelity, rows=None,
                             wire_bytes=lambda bucket, world: wire.nbytes(bucket.numel, top_count(bucket.numel, ratio),
                                                                     bucket.dtype))

    def encode(self, x, state, layout):
        flat = x.reshape(-1)
        index = torch.topk(magnitude_keys(flat), top_count(flat.numel(), self.ratio), sorted=False).indices
        return self.payload(flat, index, flat[index]), state
