"""Flat tensors laid out like a bucket that follow their parameters through DDP's bucket rebuilds and checkpoints.

Error feedback (``ResidualMemory``), DGC's momentum and velocity and Signum's momentum keep per-bucket state that
must survive two things: DDP regrouping the parameters into other buckets (its rebuild after the first step,
or a fresh DDP after a checkpoint), and a checkpoint that does not depend on how DDP happened to group them.
"""
from __future__ import annotations

import threading
from typing import Sequence

import torch

from gcomp.bucket import BucketInfo
from gcomp.core import check_state, tensor_dict


class BucketState:
    """Named slots (``"residuals"``, or ``"momentum"`` and ``"velocity"``), each one flat tensor per bucket layout.

    A layout seen for the first time takes its slots over from the pieces of the layouts it shares a
    parameter with (moved parameter by parameter, by name), or from a loaded checkpoint; ``state_dict`` stores
    every slot per parameter name: ``{slot: {parameter name: flat tensor}}``. ``spare`` entries past the
    bucket's end (DGC's scratch entry) belong to the layout, not to a parameter: they start at zero.
    """

    def __init__(self, slots: Sequence[str], spare: int = 0, owner: str = "state"):
        self.slots, self.spare, self.owner = tuple(slots), spare, owner
        self._live: dict[str, tuple[BucketInfo, dict[str, torch.Tensor]]] = {}
        self._pieces: dict[str, dict[str, torch.Tensor]] = {s: {} for s in self.slots}  # not yet placed

    def find(self, bucket: BucketInfo, like: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """The slots of ``bucket``'s layout, built from known pieces on first sight (zeros where a parameter has
        none); None when no slot holds anything for any of its parameters."""
        entry = self._live.get(bucket.key)
        if entry is not None:
            return entry[1]
        self._split_stale(set(bucket.names))
        if not any(name in self._pieces[s] for s in self.slots for name in bucket.names):
            return None
        return self._adopt(bucket, like)

    def get(self, bucket: BucketInfo, like: torch.Tensor) -> dict[str, torch.Tensor]:
        """``find``, or zeros (shaped like ``like`` plus ``spare`` entries) kept for the layout from now on."""
        found = self.find(bucket, like)
        return found if found is not None else self._adopt(bucket, like)

    def put(self, bucket: BucketInfo, tensors: dict[str, torch.Tensor]) -> None:
        """Keep ``tensors`` (every slot, laid out like ``bucket``; taken over, not copied) for the layout."""
        self._live[bucket.key] = (bucket, tensors)

    def has(self, bucket: BucketInfo) -> bool:
        """True when ``bucket``'s layout holds its slots now (``find`` will not rebuild them)."""
        return bucket.key in self._live

    def entry(self, key: str) -> tuple[BucketInfo, dict[str, torch.Tensor]]:
        """The layout with key ``key`` (``BucketInfo.key``) that holds its slots now, and the slots."""
        return self._live[key]

    def _adopt(self, bucket: BucketInfo, like: torch.Tensor) -> dict[str, torch.Tensor]:
        tensors = {}
        for slot in self.slots:
            flat = like.new_zeros(like.numel() + self.spare)
            for name, offset, numel in bucket.segments():
                piece = self._pieces[slot].pop(name, None)
                if piece is not None:
                    if piece.numel() != numel:
                        raise ValueError(f"{self.owner}: the {slot} of parameter '{name}' hold {piece.numel()} "
                                         f"elements, the bucket holds {numel} of it: this state (or the checkpoint "
                                         "it loaded) was made for another model. One state serves one DDP model "
                                         "and resumes on the model it was saved from; make a fresh state for this "
                                         "one (gcomp.install, or gcomp.comm_hook(..., model=ddp_model))")
                    flat[offset:offset + numel].copy_(piece.reshape(-1))
            tensors[slot] = flat
        self.put(bucket, tensors)
        return tensors

    def _split_stale(self, names: set[str]) -> None:
        """Cut the layouts that share a parameter with ``names`` into per-parameter pieces (views, no copy)."""
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
        """``state_dict()``'s form, checked: every slot a ``{parameter name: tensor}`` dict."""
        self.check(state)
        self._live.clear()
        self._pieces = {s: {name: t.clone() for name, t in state.get(s, {}).items()} for s in self.slots}

    def check(self, state: dict) -> None:
        """Raise ValueError naming the key unless ``state`` holds every slot, and nothing else, each as a
        ``{parameter name: tensor}`` dict."""
        check_state(self.owner, state, {slot: dict for slot in self.slots})
        for slot in self.slots:
            tensor_dict(self.owner, slot, state[slot])


class KeptInBucketState:
    """Checkpointing for a part whose whole state is one ``BucketState``, ``self._state`` (put it before
    ``Memory`` or ``Compressor`` in the bases)."""

    _state: BucketState

    def state_dict(self) -> dict:
        return self._state.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._state.load_state_dict(state)

    def parameter_state(self, state: dict) -> dict:
        return {slot: state[slot] for slot in self._state.slots}


def _unshared(t: torch.Tensor, others: int = 0) -> bool:
    """True when no tensor but ``t`` (and ``others`` more known ones) uses ``t``'s storage (no view of it,
    nothing handed out is alive)."""
    # two references: ``t`` itself and the temporary storage object asked here
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) <= 2 + others


class Scratch:
    """Work buffers kept per bucket layout across steps: not state (never checkpointed), only memory reused.

    A fresh bucket-sized allocation costs several copies of the bucket on a CPU (its pages are faulted in
    anew at every step); writing into a tensor that exists costs nothing more. ``take`` hands out a buffer that
    nobody else holds: one of the up to ``slots`` kept for the layout whose storage no other tensor shares (a
    tensor handed out earlier, or a view of it, that is still alive keeps its buffer out of reach), else a
    fresh one, kept while a slot is free. So a caller may hold what it was given as long as it likes: DDP
    holds a decoded bucket into the next step (two slots serve it), a test may hold two compensated buckets.
    A layout seen for the first time drops the buffers of the layouts it shares a parameter with (DDP's
    rebuild), as ``BucketState`` moves their state.
    """

    def __init__(self, slots: int = 1):
        self.slots = slots
        self._kept: dict[str, tuple[frozenset, list[torch.Tensor]]] = {}
        # decodes run on the backend's threads, several buckets at once, beside the next bucket's encode
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {"slots": self.slots}  # memory, not state: a copy (deepcopy, pickle) starts with no buffers

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["slots"])

    def take(self, bucket: BucketInfo, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-d tensor of ``numel`` entries, contents undefined, that no one else holds."""
        with self._lock:
            return self._take(bucket, numel, dtype, device)

    def _take(self, bucket: BucketInfo, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        entry = self._kept.get(bucket.key)
        if entry is None:
            names = frozenset(bucket.names)
            for key in [k for k, (other, _) in self._kept.items() if names & other]:
                del self._kept[key]
            entry = self._kept[bucket.key] = (names, [])
        kept = entry[1]
        for base in kept:
            if base.numel() == numel and base.dtype == dtype and base.device == device and _unshared(base):
                return base.view(numel)  # a tensor of its own, sharing the storage: what ``_unshared`` counts
        base = torch.empty(numel, dtype=dtype, device=device)
        self._keep(kept, base)
        return base.view(numel)

    def _keep(self, kept: list[torch.Tensor], base: torch.Tensor) -> None:
        """Keep a fresh buffer in the layout's list ``kept``: those of another size or dtype are given up, and
        the fresh one is kept while a slot is free."""
        kept[:] = [b for b in kept if b.numel() == base.numel() and b.dtype == base.dtype and b.device == base.device]
        if len(kept) < self.slots:
            kept.append(base)

    def keeps(self, bucket: BucketInfo, t: torch.Tensor) -> bool:
        """True when ``t`` is (a view of) one of the buffers kept for ``bucket``'s layout."""
        with self._lock:
            entry = self._kept.get(bucket.key)
            return entry is not None and any(_same_storage(base, t) for base in entry[1])

    def alone(self, t: torch.Tensor) -> bool:
        """True when nothing but ``t`` uses its storage, besides this scratch keeping it: ``t`` may be written
        over without changing a tensor someone else holds."""
        with self._lock:
            kept = any(_same_storage(base, t) for _, bases in self._kept.values() for base in bases)
        return _unshared(t, others=1 if kept else 0)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
