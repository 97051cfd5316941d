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

    Memory per layout: the residual, and the buffers the compensated bucket is written into
    (``gcomp.bucket_state.Scratch``, two kept; a fresh one only while both are held). The update, fastest first:

    - ``Compressor.sent_positions``: the codec sent some entries of a finite bucket exactly (randomk on a CPU).
      The compensated bucket, when it is one of those buffers, becomes the residual as it is, those positions
      read as 0: k entries remembered, no pass over the bucket. The old residual's buffer takes the next
      compensated bucket. Such a ``v`` must not be written after ``update``, but reading it stays valid: the
      zeros are written into it by the next ``compensate`` only once no one else holds it (else that adds
      the gradient alone there), and into a copy before a checkpoint or a new layout.
    - ``Compressor.residual_into``: the codec writes ``v`` less its few sent entries over the old residual (a
      copy, non-finite entries dropped; topk, threshold, randomk otherwise), nothing decoded.
    - else ``v`` less ``Compressor.decompress`` of the payload.

    The old residual is written over only when nothing else holds it (a ``v`` handed out earlier that became
    the residual may still be held); else the new one goes into a fresh tensor.
    """

    stateful = True

    def __init__(self):
        self._state = BucketState(("residuals",), owner="ResidualMemory")
        self._sums = Scratch(slots=2)  # the compensated buckets: the residual and the next sum, in turn
        self._zeros: dict[str, torch.Tensor] = {}  # per layout key: positions the kept residual reads as 0

    def compensate(self, tensor: torch.Tensor, bucket: BucketInfo) -> torch.Tensor:
        held = self._find(bucket, tensor)
        if held is None:
            return tensor
        residual = held["residuals"]
        zeros = self._zeros.get(bucket.key)
        if zeros is not None and self._sums.alone(residual):  # no one reads the old compensated bucket now
            residual.index_fill_(0, self._zeros.pop(bucket.key), 0)
            zeros = None
        out = self._sums.take(bucket, tensor.numel(), tensor.dtype, tensor.device).view_as(tensor)
        torch.add(tensor, residual.view_as(tensor), out=out)
        if zeros is not None:  # the residual is 0 there: the gradient alone
            out.view(-1).index_copy_(0, zeros, tensor.reshape(-1).index_select(0, zeros))
        return out

    def update(self, tensor: torch.Tensor, bucket: BucketInfo, compressor: Compressor, payload: Payload) -> None:
        held = self._find(bucket, tensor)
        sent = compressor.sent_positions(payload)
        if sent is not None and self._sums.keeps(bucket, tensor):  # ours: it becomes the residual, no pass
            self._state.put(bucket, {"residuals": tensor.view(-1)})
            self._zeros[bucket.key] = sent
            return
        self._zeros.pop(bucket.key, None)  # the old residual is written over whole (or dropped)
        # The old residual is already inside ``tensor`` (compensate), so its storage takes the new one, unless
        # someone else still holds it (a compensated bucket that became the residual).
        old = None if held is None else held["residuals"]
        if old is None or not self._sums.alone(old):
            old = torch.empty(tensor.numel(), dtype=tensor.dtype, device=tensor.device)  # not a view: alone
        residual = old
        if compressor.residual_into(residual.view_as(tensor), tensor, payload):  # no decode
            self._state.put(bucket, {"residuals": residual})
            return
        sent = compressor.decompress(payload.tensors, payload.ctx)
        self.store(torch.sub(tensor.reshape(-1), sent.reshape(-1), out=residual), bucket)

    def store(self, residual: torch.Tensor, bucket: BucketInfo) -> None:
        """Keep ``residual`` (a flat tensor laid out like ``bucket``, taken over, not copied) as what the next
        ``compensate`` adds. Methods whose residual is only known after the exchange (SparDL's global residual
        collection, gTop-k) call this themselves instead of ``update``."""
        self._zeros.pop(bucket.key, None)
        self._state.put(bucket, {"residuals": torch.nan_to_num_(residual, nan=0.0, posinf=0.0, neginf=0.0)})

    def flush(self, bucket: BucketInfo, like: torch.Tensor) -> torch.Tensor | None:
        held = self._find(bucket, like)
        if held is None:
            return None
        residual = held["residuals"].clone()  # the kept one may be a compensated bucket still being read
        zeros = self._zeros.pop(bucket.key, None)
        if zeros is not None:
            residual.index_fill_(0, zeros, 0)
        self._state.put(bucket, {"residuals": torch.zeros_like(residual)})
        return residual

    def _find(self, bucket: BucketInfo, like: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """``BucketState.find``, once the zeros owed are written wherever a new layout would split residuals."""
        if self._zeros and not self._state.has(bucket):
            self._settle(keep=bucket.key)
        return self._state.find(bucket, like)

    def _settle(self, keep: str | None = None) -> None:
        """Write the zeros owed into copies of the residuals (the compensated buckets they were stay as they
        were), for every layout but ``keep``: before a checkpoint or a change of layout, not at a step."""
        for key in [k for k in self._zeros if k != keep]:
            zeros = self._zeros.pop(key)
            layout, tensors = self._state.entry(key)
            self._state.put(layout, {"residuals": tensors["residuals"].clone().index_fill_(0, zeros, 0)})

    def state_dict(self) -> dict:
        self._settle()
        return super().state_dict()

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._zeros.clear()

    def merge_states(self, assigned: list[dict], every: list[dict], rank: int) -> dict:
        return {"residuals": sum_by_name([s["residuals"] for s in assigned])}
