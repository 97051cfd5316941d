"""``threshold``: every entry whose magnitude passes a fixed threshold, with error feedback, by sized all-gather."""
from __future__ import annotations

from typing import Annotated

import torch
import torch.distributed as dist

from gcomp.bucket import index_dtype
from gcomp.collectives import coded_positions, narrow_values
from gcomp.collectives.allgather_sized import SizedAllgatherCommunicator, SizedCodec, SizedPayload
from gcomp.compressors.sparse import (PositionsParam, SparseCompressor, ValuesParam, magnitude_keys,
                                     positions_at_least)
from gcomp.kernels import on_device
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


class ThresholdCompressor(SparseCompressor, SizedCodec):
    """Sends the entries whose local magnitude exceeds ``threshold``, as many as there are (``k``, differing per
    rank and step): their values (``values``: the bucket's dtype, bf16, fp16, or fp8_e4m3 with one fp32 scale;
    the rounding stays in the residual) and their positions, coded (``gcomp.collectives.coded_positions``: the
    smaller of a bitmap and Elias-Fano, ``coded_bytes(n, k)`` bytes, the form chosen from this rank's k) or raw
    (int32, int64 past 2**31 elements). On the wire (``SizedAllgatherCommunicator``): one int64 count per rank,
    then by all-gather the values zero-padded to the largest count, the codes zero-padded to the largest code
    (raw positions: to the largest count), fp8's scale as one row. Each rank's code is decoded with its own k,
    read from the sizes round. Entries several ranks chose are summed. Bytes per rank and bucket, V the value's
    bits: ``8 + V/8 max(1, max_r k_r) + max(1, max_r coded_bytes(n, k_r))`` (+ 4 with fp8), the code about
    L + 1 + n / (k 2**L) bits a position with L = max(0, floor(log2(n / k))); raw: ``8 + (V/8 + 4) max(1, max_r k_r)``.

    The threshold is on the local gradient: the hook hands over ``g / world``, so that is compared with
    ``threshold / world``. NaN and infinities always pass. The entries are found in one chunked pass over the
    bucket (``positions_at_least``) with no bucket-sized mask or magnitude tensor.

    On the device path (``gcomp.kernels.on_device``) the count is never read by the codec: the payload is a
    ``SizedPayload`` of bucket-sized buffers, the passing entries first (ascending, by ``nonzero_static``), zero
    values past them, and their count on the device; the sized all-gather reads the longest count, the bucket's
    one host synchronisation, and sends that many. The same entries go, in the same order, as on the CPU; the
    buffers cost a bucket of values and of int64 positions while the bucket is encoded. Coded positions are
    encoded there once the sized all-gather knows this rank's count (``finish``): the code of the same sorted
    positions as the CPU path's, so the same bytes go.
    """

    def __init__(self, threshold: float, positions: str = "raw", values: str = "fp32"):
        self.threshold = threshold
        self.wire(positions, values)
        self.world_size = 1
        self._floors: dict[torch.dtype, torch.Tensor] = {}
        self._floor_keys: dict[torch.dtype, int] = {}

    def bind(self, model, group, stats) -> None:
        self._floors.clear()
        self._floor_keys.clear()
        if dist.is_available() and dist.is_initialized():
            self.world_size = dist.get_world_size(group)

    def _floor(self, dtype: torch.dtype) -> torch.Tensor:
        """The threshold as a magnitude key of ``dtype``, above which NaN and infinities lie too: they are always
        sent. On the CPU, made once per dtype."""
        floor = self._floors.get(dtype)
        if floor is None:
            floor = self._floors[dtype] = magnitude_keys(torch.tensor(
                _floor_to(self.threshold / self.world_size, dtype), dtype=dtype))
        return floor

    def compress(self, tensor, bucket):
        flat = tensor.reshape(-1)
        if on_device(flat):
            return self._compress_on_device(flat, tensor, bucket)
        # the count decides the payload's size: a host sync is inherent
        index = positions_at_least(flat, self._floor(tensor.dtype).to(tensor.device), index_dtype(flat.numel()),
                                   strict=True)
        return self.sparse_payload(flat[index], index, tensor, bucket)

    def _passing(self, flat: torch.Tensor) -> torch.Tensor:
        """The bucket-sized mask of the entries sent (device path)."""
        key = self._floor_keys.get(flat.dtype)
        if key is None:  # a Python integer: compared exactly with the keys, and no copy to the device
            key = self._floor_keys[flat.dtype] = int(self._floor(flat.dtype))
        return magnitude_keys(flat) > key

    def _compress_on_device(self, flat, tensor, bucket) -> SizedPayload:
        n = flat.numel()
        passing = self._passing(flat)
        found = torch.nonzero_static(passing, size=n, fill_value=n).squeeze(1)  # ascending, then n: no count read
        real = found < n
        index = found.clamp_(max=n - 1)  # padding: a zero value at the last position
        # raw positions in the buffers: coded ones are encoded by ``finish``, when the count is on the host
        plain = self.sparse_payload(torch.where(real, flat[index], 0), index, tensor, bucket, positions="raw")
        return SizedPayload(plain.tensors, plain.ctx, length=passing.sum())  # fp8's scale: padding past it

    # --- the sized all-gather (``SizedCodec``) ---------------------------------------------------------------

    def rows(self, ctx, count: int) -> list[int]:
        """Values: ``count``; positions: ``coded_bytes(n, count)`` bytes, or ``count`` raw; fp8's scale: 1."""
        where = coded_positions.coded_bytes(ctx.n, count) if self.positions == "coded" else count
        return [count, where] + [1] * bool(narrow_values.scale_bytes(ctx.values))

    def finish(self, payload, count: int) -> list[torch.Tensor]:
        if not (isinstance(payload, SizedPayload) and self.positions == "coded"):
            return payload.tensors  # the CPU path's code, made in ``compress``
        tensors = list(payload.tensors)
        tensors[1] = coded_positions.encode(tensors[1][:count], payload.ctx.n)  # ascending, distinct
        return tensors

    def aggregate_counts(self, gathered, counts, ctx):
        """Raw positions: the padded stack at once (padding adds nothing). Coded: each rank's code with its own
        count (its form and size depend on it), the values cut alike, then one ``index_add_``, in rank order as
        the raw path adds them."""
        if self.positions != "coded":
            return self.aggregate(gathered, ctx)
        scale = gathered[2][..., :1] if len(gathered) > 2 else None
        values = narrow_values.widen(gathered[0], ctx.values, scale, ctx.dtype)
        code, n = gathered[1], ctx.n
        size = coded_positions.coded_bytes
        index = torch.cat([coded_positions.decode(code[r, :size(n, k)], n, k) for r, k in enumerate(counts)])
        values = torch.cat([values[r, :k] for r, k in enumerate(counts)])
        if ctx.scratch is None:
            return torch.zeros(n, dtype=ctx.dtype, device=values.device).index_add_(0, index, values)
        return ctx.scratch.take(ctx.bucket, n, ctx.dtype, values.device).zero_().index_add_(0, index, values)

    def residual_into(self, out, tensor, payload):
        if not isinstance(payload, SizedPayload):
            return super().residual_into(out, tensor, payload)
        # the padding repeats a position: the sent entries, all of those passing and only those, read as 0
        flat = tensor.reshape(-1)
        out.view(-1).copy_(flat).masked_fill_(self._passing(flat), 0)
        if self.values != "fp32":  # what rounding took off the sent entries, the padding past the count adding 0
            ctx = payload.ctx
            real = torch.arange(ctx.index.numel(), device=flat.device) < payload.length
            left = torch.nan_to_num_(flat[ctx.index] - ctx.sent, nan=0.0, posinf=0.0, neginf=0.0)
            out.view(-1).index_add_(0, ctx.index, torch.where(real, left, 0))
        return True


@register("threshold", paper="Strom 2015 (Scalable distributed DNN training using commodity GPU cloud computing)")
def threshold(threshold: Annotated[float, Range(0, None), "send entries of the local gradient with |g| above this"]
              = 0.01,
              positions: PositionsParam = "coded", values: ValuesParam = "fp32") -> Method:
    """Threshold sparsification with error feedback: a variable count per rank, sizes exchanged, then all-gather."""
    return Method(ThresholdCompressor(threshold, positions, values), ResidualMemory(), SizedAllgatherCommunicator())
