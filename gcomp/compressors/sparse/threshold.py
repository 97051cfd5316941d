"""``threshold``: every entry whose magnitude passes a fixed threshold, as many as there are."""
from __future__ import annotations

import torch
import torch.distributed as dist

from gcomp.bucket import index_dtype
from gcomp.collectives.sized import SizedCompressor, SizedPayload
from gcomp.collectives.sparse_wire import SparseWire, coded_bytes, encode_positions, narrow
from gcomp.compressors.sparse.topk import SparseCompressor, SparseCtx, magnitude_keys
from gcomp.core import ALLGATHER, Traits

_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def floor_to(value: float, dtype: torch.dtype) -> float:
    """The largest finite ``dtype`` value <= ``value`` (>= 0): comparing with it is exact, where comparing with
    ``value`` would round it to the nearest ``dtype`` value first, up or down."""
    exact = torch.tensor(value, dtype=torch.float64)
    rounded = exact.to(dtype).clamp(max=torch.finfo(dtype).max)
    if rounded.double() > exact:  # positive floats: the bit pattern minus one is the next value down
        rounded = (rounded.view(_BITS[rounded.element_size()]) - 1).view(dtype)
    return float(rounded)


class ThresholdCompressor(SparseCompressor, SizedCompressor):
    """Sends the entries whose local magnitude exceeds ``threshold`` (NaN and infinities always), as many as pass
    (``k``, differing per rank and step), by the sized all-gather (``SizedAllgatherCommunicator``): one int64 count per
    rank, then the values zero-padded to the largest count, the positions zero-padded to the largest code (coded:
    ``coded_bytes(n, k)`` bytes, the form chosen from this rank's k; raw: int32, int64 past 2**31 entries, to the
    largest count), fp8's scale as one row. Each rank's code is decoded with its own k; entries several ranks chose are
    summed. Bytes per rank and bucket, V the value's bits: ``8 + V/8 max(1, max_r k_r) + max(1, max_r
    coded_bytes(n, k_r))`` (+ 4 with fp8); raw: ``8 + (V/8 + 4) max(1, max_r k_r)``.

    The hook hands over ``g / world``, so that is compared with ``threshold / world``. The codec never reads the
    count: its tensors are bucket-sized buffers, the passing entries first (ascending, by ``nonzero_static``), zeros
    past them, the count on the device; the communicator reads the longest (the bucket's one host synchronisation),
    and coded positions are encoded once this rank's count is on the host (``finish``)."""

    def __init__(self, threshold: float, positions: str = "raw", values: str = "fp32"):
        super().__init__(positions, values)
        self.threshold = threshold
        self.traits = Traits(ALLGATHER, self.wire.fidelity, rows=None)
        self.world_size = 1

    def bind(self, model, group, stats) -> None:
        self.world_size = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1

    @property
    def world_size(self) -> int:
        return self._world

    @world_size.setter
    def world_size(self, world: int) -> None:
        # the threshold as a magnitude key of each dtype (a Python integer: compared exactly, no copy to a device)
        self._world, self.floors = world, {dtype: int(magnitude_keys(torch.tensor(
            floor_to(self.threshold / world, dtype), dtype=dtype))) for dtype in _FLOATS}

    def encode(self, x, state, layout):
        flat = x.reshape(-1)
        n = flat.numel()
        passing = magnitude_keys(flat) > self.floors[flat.dtype]
        found = torch.nonzero_static(passing, size=n, fill_value=n).squeeze(1)  # ascending, then n: no count read
        real = found < n
        index = found.clamp_(max=n - 1)  # padding: a zero value at the last position
        wire, scale, sent = narrow(torch.where(real, flat[index], 0), self.wire.values)
        residual = flat.masked_fill(passing, 0)
        if self.wire.values != "fp32":  # what rounding took off the sent entries, the padding adding 0
            residual.index_add_(0, index, torch.where(real, flat[index] - sent, 0))
        tensors = [wire, index.to(index_dtype(n))] + ([] if scale is None else [scale])
        return SizedPayload(tensors, SparseCtx(n, flat.dtype, n), residual=residual, length=passing.sum()), state

    def rows(self, ctx, count: int) -> list[int]:
        """Values: ``count``; positions: ``coded_bytes(n, count)`` bytes, or ``count`` raw; fp8's scale: 1."""
        where = coded_bytes(ctx.n, count) if self.wire.positions == "coded" else count
        return [count, where] + [1] * (self.wire.values == "fp8_e4m3")

    def finish(self, payload, count: int) -> list[torch.Tensor]:
        if self.wire.positions != "coded":
            return payload.tensors
        return [payload.tensors[0], encode_positions(payload.tensors[1][:count], payload.ctx.n), *payload.tensors[2:]]

    def decode(self, received, ctx):
        """``(gathered, counts)`` from the sized all-gather: raw positions, the padded stack at once; coded, each
        rank's code with its own count, in rank order. A plain stack (a payload decoded alone) holds raw positions."""
        if not isinstance(received, tuple):
            received = (received, None)
        gathered, counts = received
        raw = SparseWire("raw", self.wire.values)
        if counts is None or self.wire.positions == "raw":
            index, values = raw.decode(gathered, ctx.n, gathered[0].shape[1], ctx.dtype)
        else:
            parts = [self.wire.decode([gathered[0][r, :k], gathered[1][r, :coded_bytes(ctx.n, k)],
                                       *[t[r] for t in gathered[2:]]], ctx.n, k, ctx.dtype) for r, k in enumerate(counts)]
            index, values = torch.cat([p[0].view(-1) for p in parts]), torch.cat([p[1].view(-1) for p in parts])
        out = torch.zeros(ctx.n, dtype=ctx.dtype, device=values.device)
        return out.index_add_(0, index.reshape(-1), values.reshape(-1))
