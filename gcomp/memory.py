"""Error-feedback memories."""
from __future__ import annotations

import torch

from gcomp.bucket import BucketInfo
from gcomp.core import Compressor, Memory, Payload


class NoMemory(Memory):
    """No error feedback: the gradient is compressed as it is."""

    def compensate(self, tensor: torch.Tensor, bucket: BucketInfo) -> torch.Tensor:
        return tensor

    def update(self, tensor, bucket, compressor, payload) -> None:
        pass


class ResidualMemory(Memory):
    """Keeps ``residual = v - decompress(compress(v))`` per bucket and adds it to the next gradient.

    Residuals are kept as one flat tensor per bucket layout. When DDP changes the layout (its bucket rebuild,
    or a fresh DDP after a checkpoint) they are moved parameter by parameter onto the new layout, and
    ``state_dict`` stores them per parameter name, so nothing is lost at a rebuild and a checkpoint does not
    depend on how DDP happened to group the parameters.

    Non-finite residual entries are dropped (set to zero): one overflowing step, which AMP skips anyway, must
    not poison every later step.
    """

    stateful = True

    def __init__(self):
        self._residuals: dict[str, torch.Tensor] = {}
        self._layouts: dict[str, BucketInfo] = {}
        self._by_param: dict[str, torch.Tensor] = {}  # residuals not yet placed in a known layout

    def compensate(self, tensor: torch.Tensor, bucket: BucketInfo) -> torch.Tensor:
        residual = self._residuals.get(bucket.key)
        if residual is None:
            residual = self._adopt(bucket, tensor)
        return tensor if residual is None else tensor + residual

    def update(self, tensor: torch.Tensor, bucket: BucketInfo, compressor: Compressor, payload: Payload) -> None:
        sent = compressor.decompress(payload.tensors, payload.ctx)
        residual = self._residuals.get(bucket.key)
        if residual is None:
            residual = torch.empty_like(tensor)
        # The old residual is already inside ``tensor`` (compensate), so its storage takes the new one.
        self.store(torch.sub(tensor, sent, out=residual), bucket)

    def store(self, residual: torch.Tensor, bucket: BucketInfo) -> None:
        """Keep ``residual`` (a flat tensor laid out like ``bucket``, taken over, not copied) as what the next
        ``compensate`` adds. Methods whose residual is only known after the exchange (SparDL's global residual
        collection, gTop-k) call this themselves instead of ``update``."""
        self._residuals[bucket.key] = torch.nan_to_num_(residual, nan=0.0, posinf=0.0, neginf=0.0)
        self._layouts[bucket.key] = bucket

    def _adopt(self, bucket: BucketInfo, like: torch.Tensor) -> torch.Tensor | None:
        """A layout seen for the first time: build its residual from per-parameter pieces."""
        self._explode(set(bucket.names))
        if not any(name in self._by_param for name in bucket.names):
            return None
        residual = torch.zeros_like(like)
        for name, offset, numel in bucket.segments():
            piece = self._by_param.pop(name, None)
            if piece is not None:
                if piece.numel() != numel:
                    raise ValueError(f"residual for parameter '{name}' has {piece.numel()} elements, "
                                     f"the bucket holds {numel}")
                residual[offset:offset + numel].copy_(piece.reshape(-1))
        return residual

    def _explode(self, names: set[str]) -> None:
        """Split the residuals of stale layouts (those sharing a parameter with ``names``) per parameter."""
        stale = [key for key, layout in self._layouts.items() if names.intersection(layout.names)]
        for key in stale:
            residual, layout = self._residuals.pop(key), self._layouts.pop(key)
            for name, offset, numel in layout.segments():
                self._by_param[name] = residual[offset:offset + numel]

    def state_dict(self) -> dict:
        per_param = dict(self._by_param)
        for key, residual in self._residuals.items():
            for name, offset, numel in self._layouts[key].segments():
                per_param[name] = residual[offset:offset + numel].clone()
        return {"residuals": per_param}

    def load_state_dict(self, state: dict) -> None:
        unknown = set(state) - {"residuals"}
        if unknown:
            raise ValueError(f"ResidualMemory: unexpected keys {sorted(unknown)}")
        self._residuals.clear()
        self._layouts.clear()
        self._by_param = {name: t.clone() for name, t in state.get("residuals", {}).items()}
