"""A resumed run's first buckets, reduced as the saved run laid them out (docs/checkpoints-and-faults.md).

For as many steps as a fresh DDP keeps its first buckets, a bucket holding exactly the parameters of saved layouts
is cut into them, each reduced on its own in the saved order, and put back: one copy each way, on those steps only.
"""
from __future__ import annotations

import torch

from gcomp.bucket import BucketInfo

# one piece of a live bucket reduced as a saved layout: the layout, and where each of its parameters lies in
# the live bucket (offset, numel), in the layout's order
Piece = tuple[BucketInfo, list[tuple[int, int]]]


class SavedLayouts:
    """A loaded checkpoint's bucket layouts (``loaded``), for the ``left`` first steps of the resumed run."""

    def __init__(self):
        self.loaded: list[tuple[int, tuple[str, ...]]] = []  # (bucket index, names) of a loaded checkpoint
        self.left = 0  # steps the loaded layouts still apply to

    def state(self, last: list[BucketInfo]) -> list[dict]:
        """``[{"index": i, "names": [...]}, ...]``: the ``last`` step's layouts, or those a load left that no step
        has replaced yet (a checkpoint saved right after a load holds what the loaded one did)."""
        if last:
            return [{"index": info.index, "names": list(info.names)} for info in last]
        return [{"index": index, "names": list(names)} for index, names in self.loaded]

    @staticmethod
    def check(value) -> list[tuple[int, tuple[str, ...]]]:
        """A checkpoint's ``layouts``, checked: a ValueError naming what is wrong."""
        where = "gcomp checkpoint: 'layouts'"
        if not isinstance(value, list):
            raise ValueError(f"{where} must be a list of bucket layouts, got {type(value).__name__}")
        out, seen = [], set()
        for i, entry in enumerate(value):
            if not (isinstance(entry, dict) and set(entry) == {"index", "names"}
                    and isinstance(entry["index"], int) and not isinstance(entry["index"], bool)
                    and entry["index"] >= 0 and isinstance(entry["names"], list)
                    and all(isinstance(n, str) for n in entry["names"])):
                raise ValueError(f"{where}[{i}] must be {{'index': bucket index (int, at least 0), 'names': "
                                 f"[parameter names]}}, got {entry!r:.200}")
            if seen.intersection(entry["names"]):
                raise ValueError(f"{where}[{i}]: parameter {sorted(seen.intersection(entry['names']))[0]!r} is in "
                                 "two buckets")
            seen.update(entry["names"])
            out.append((entry["index"], tuple(entry["names"])))
        return out

    def load(self, layouts: list[tuple[int, tuple[str, ...]]], steps: int) -> None:
        """Apply ``layouts`` (``check``'s) to the next ``steps`` steps (those DDP takes on its first buckets)."""
        self.loaded, self.left = layouts, steps

    def pieces(self, bucket: BucketInfo) -> list[Piece] | None:
        """How a live bucket is reduced as saved layouts: None when it is reduced as it is (no loaded layouts
        apply, it is one of them, or it does not hold exactly the parameters of some of them)."""
        if not self.left or not self.loaded:
            return None
        live = {name: (offset, numel) for name, offset, numel in bucket.segments()}
        chosen = [(index, saved) for index, saved in self.loaded if live.keys() & set(saved)]
        if any(not live.keys() >= set(saved) for _, saved in chosen) or \
                sum(len(saved) for _, saved in chosen) != len(live):
            return None  # not a union of saved layouts: DDP grouped it otherwise
        if chosen == [(bucket.index, bucket.names)]:
            return None  # the saved layout itself
        return [(BucketInfo.from_layout(index, bucket.dtype, saved, [live[n][1] for n in saved]),
                 [live[n] for n in saved]) for index, saved in sorted(chosen)]


def gather(buffer: torch.Tensor, where: list[tuple[int, int]]) -> torch.Tensor:
    """The entries of ``buffer`` at ``where`` ((offset, numel) each), concatenated: a new tensor."""
    return torch.cat([buffer[offset:offset + numel] for offset, numel in where])


def scatter(out: torch.Tensor, piece: torch.Tensor, where: list[tuple[int, int]]) -> None:
    """Write ``piece`` (``gather``'s layout) back into ``out`` at ``where``."""
    at = 0
    for offset, numel in where:
        out[offset:offset + numel].copy_(piece[at:at + numel])
        at += numel
