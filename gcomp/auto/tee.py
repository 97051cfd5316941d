"""A statistics dict that is also counted into another: one bucket's counters, kept apart while they add up in
the hook's."""
from __future__ import annotations


class TeeStats(dict):
    """Starts at zero for ``parent``'s keys; every ``stats[key] = value`` also adds the change to ``parent[key]``.

    ``auto`` hands one to the method it runs on a bucket, so that the hook's totals count as usual while the
    bucket's own encode, decode and round seconds and its collectives can be read back, whole, once its
    result is ready (the decode is counted in a callback, after ``reduce`` returned)."""

    __slots__ = ("parent",)

    def __init__(self, parent: dict):
        super().__init__({key: value * 0 for key, value in parent.items()})
        self.parent = parent

    def __setitem__(self, key, value) -> None:
        delta = value - self.get(key, 0)
        super().__setitem__(key, value)
        if key in self.parent:
            self.parent[key] += delta
