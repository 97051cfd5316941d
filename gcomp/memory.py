"""Error-feedback memories."""
from __future__ import annotations

import torch

from gcomp.bucket import BucketInfo
from gcomp.bucket_state import BucketState, KeptInBucketState, Scratch
from gcomp.core import Compressor, Memory, Payload, sum_by_name


class NoMemory(Memory):
    """No error feedback: the gradient is compressed as it is."""

    def compensate(self, tensor: torch.Tensor, bucket: BucketInfo) -> torch.Tensor:
        return tensor

    def update(self, tensor, bucket, compressor, payload) -> None:
        pass


class ResidualMemory(KeptInBucketState, Memory):
    """Keeps ``residual = v - decompress(compress(v))`` per bucket and adds it to the next gradient.

    Residuals are kept as one flat tensor per bucket layout (``gcomp.bucket_state.BucketState``). When DDP
    changes the layout (its bucket rebuild, or a fresh DDP after a checkpoint) they are moved parameter by
    parameter onto the new layout, and ``state_dict`` stores them per parameter name, so nothing is lost at a
    rebuild and a checkpoint does not depend on how DDP happened to group the parameters.

    Non-finite residual entries are dropped (set to zero): one overflowing step, which AMP skips anyway, must
    not poison every later step.

    Memory per layout: the residual, and one buffer the compensated bucket is written into at every step
    (``gcomp.bucket_state.Scratch``; a fresh one only while the last is still held). The update writes the new
    residual over the old one: through ``Compressor.residual_into`` where the codec offers it (the sparse
    codecs: a copy of the compensated bucket, then their few sent entries subtracted), else as the compensated
    bucket less ``Compressor.decompress`` of the payload.
    """

    stateful = True

    def __init__(self):
        self._state = BucketState(("residuals",), owner="ResidualMemory")
        self._sums = Scratch()  # the compensated bucket, written into the same buffer every step

    def compensate(self, tensor: torch.Tensor, bucket: BucketInfo) -> torch.Tensor:
        held = self._state.find(bucket, tensor)
        if held is None:
            return tensor
        out = self._sums.take(bucket, tensor.numel(), tensor.dtype, tensor.device).view_as(tensor)
        return torch.add(tensor, held["residuals"], out=out)

    def update(self, tensor: torch.Tensor, bucket: BucketInfo, compressor: Compressor, payload: Payload) -> None:
        held = self._state.find(bucket, tensor)
        # The old residual is already inside ``tensor`` (compensate), so its storage takes the new one.
        residual = torch.empty_like(tensor) if held is None else held["residuals"]
        if compressor.residual_into(residual, tensor, payload):  # a codec that knows what it sent: no decode
            self._state.put(bucket, {"residuals": residual})
            return
        sent = compressor.decompress(payload.tensors, payload.ctx)
        self.store(torch.sub(tensor, sent, out=residual), bucket)

    def store(self, residual: torch.Tensor, bucket: BucketInfo) -> None:
        """Keep ``residual`` (a flat tensor laid out like ``bucket``, taken over, not copied) as what the next
        ``compensate`` adds. Methods whose residual is only known after the exchange (SparDL's global residual
        collection, gTop-k) call this themselves instead of ``update``."""
        self._state.put(bucket, {"residuals": torch.nan_to_num_(residual, nan=0.0, posinf=0.0, neginf=0.0)})

    def merge_states(self, assigned: list[dict], every: list[dict], rank: int) -> dict:
        return {"residuals": sum_by_name([s["residuals"] for s in assigned])}
