"""State kept per bucket layout across DDP's rebuilds and checkpoints (``LayoutState``), and error feedback
(``NoMemory``, ``ResidualMemory``) kept in it.

DDP regroups parameters into other buckets after its first step, and a resumed run builds a fresh DDP whose
buckets may be grouped otherwise; so per-bucket tensors (residuals, a compressor's momentum) are one flat tensor
per layout, moved parameter by parameter onto a new layout, and stored per parameter name in checkpoints.
"""
from __future__ import annotations

from typing import Sequence

import torch

from gcomp.bucket import BucketInfo
from gcomp.core import Memory
from gcomp.state_checks import check_state, sum_by_name, tensor_dict


class LayoutState:
    """Named slots (``"residuals"``; a compressor's ``Traits.slots``), each one flat tensor per bucket layout.

    A layout seen for the first time takes its slots over from the pieces of the layouts it shares a parameter
    with, or from a loaded checkpoint (zeros where a parameter has none); ``state_dict`` is
    ``{slot: {parameter name: flat tensor}}``."""

    def __init__(self, slots: Sequence[str], owner: str = "state"):
        self.slots, self.owner = tuple(slots), owner
        self._live: dict[str, tuple[BucketInfo, dict[str, torch.Tensor]]] = {}
        self._pieces: dict[str, dict[str, torch.Tensor]] = {s: {} for s in self.slots}  # not placed yet

    def find(self, bucket: BucketInfo, like: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """The slots of ``bucket``'s layout (built from known pieces on first sight); None when none is held."""
        entry = self._live.get(bucket.key)
        if entry is not None:
            return entry[1]
        self._split_stale(set(bucket.names))
        if not any(name in self._pieces[s] for s in self.slots for name in bucket.names):
            return None
        return self._adopt(bucket, like)

    def get(self, bucket: BucketInfo, like: torch.Tensor) -> dict[str, torch.Tensor]:
        """``find``, or zeros shaped like ``like``, kept for the layout from now on."""
        found = self.find(bucket, like)
        return found if found is not None else self._adopt(bucket, like)

    def put(self, bucket: BucketInfo, tensors: dict[str, torch.Tensor]) -> None:
        """Keep ``tensors`` (every slot, flat, laid out like ``bucket``; taken over, not copied)."""
        self._live[bucket.key] = (bucket, tensors)

    def _adopt(self, bucket: BucketInfo, like: torch.Tensor) -> dict[str, torch.Tensor]:
        tensors = {}
        for slot in self.slots:
            flat = like.new_zeros(like.numel())
            for name, offset, numel in bucket.segments():
                piece = self._pieces[slot].pop(name, None)
                if piece is not None:
                    if piece.numel() != numel:
                        raise ValueError(f"{self.owner}: the {slot} of parameter '{name}' hold {piece.numel()} "
                                         f"elements, the bucket holds {numel} of it: this state (or the checkpoint "
                                         "it loaded) was made for another model. One state serves one model; make "
                                         "a fresh one for this model (gcomp.install)")
                    flat[offset:offset + numel].copy_(piece.reshape(-1))
            tensors[slot] = flat
        self.put(bucket, tensors)
        return tensors

    def _split_stale(self, names: set[str]) -> None:
        """Cut the layouts that share a parameter with ``names`` into per-parameter pieces (views)."""
        for key in [k for k, (layout, _) in self._live.items() if names.intersection(layout.names)]:
            layout, tensors = self._live.pop(key)
            for slot in self.slots:
                for name, offset, numel in layout.segments():
                    self._pieces[slot][name] = tensors[slot][offset:offset + numel]

    def state_dict(self) -> dict:
        out = {slot: dict(self._pieces[slot]) for slot in self.slots}
        for layout, tensors in self._live.values():
            for slot in self.slots:
                for name, offset, numel in layout.segments():
                    out[slot][name] = tensors[slot][offset:offset + numel].clone()
        return out

    def load_state_dict(self, state: dict) -> None:
        check_state(self.owner, state, {slot: dict for slot in self.slots})
        for slot in self.slots:
            tensor_dict(self.owner, slot, state[slot])
        self._live.clear()
        self._pieces = {s: {name: t.clone() for name, t in state[s].items()} for s in self.slots}


class NoMemory(Memory):
    """No error feedback: the gradient is compressed as it is."""

    def compensate(self, x, bucket):
        return x


class ResidualMemory(Memory):
    """Keeps ``residual = v - decode(payload)`` per bucket layout (``LayoutState``) and adds it to the next
    gradient. Non-finite residual entries are dropped: one overflowing step (which AMP skips) must not poison every
    later one."""

    stateful = True

    def __init__(self):
        self._state = LayoutState(("residuals",), owner="ResidualMemory")

    def compensate(self, x, bucket):
        held = self._state.find(bucket, x)
        return x if held is None else x + held["residuals"].view_as(x)

    def update(self, v, bucket, residual):
        self._state.put(bucket, {"residuals": torch.nan_to_num(residual.reshape(-1), nan=0.0, posinf=0.0,
                                                               neginf=0.0)})

    def flush(self, bucket, like):
        held = self._state.find(bucket, like)
        if held is None:
            return None
        residual = held["residuals"]
        self._state.put(bucket, {"residuals": torch.zeros_like(residual)})
        return residual

    def state_dict(self) -> dict:
        return self._state.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._state.load_state_dict(state)

    def parameter_state(self, state: dict) -> dict:
        return {"residuals": state["residuals"]}

    def merge_states(self, assigned: list[dict], every: list[dict], rank: int) -> dict:
        return {"residuals": sum_by_name([s["residuals"] for s in assigned])}
