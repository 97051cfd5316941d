"""Layout-free row sums on the device path of the sign family and ``onebit``: every parameter's entries summed in
rows of ``ROW`` from the parameter's own start, in two aten operations for the whole bucket.

The CPU path (``sign.row_plan``) sums each parameter's rows in a loop. Here one ``split`` and one ``cat`` copy the
bucket's parameters in the order of their names, each padded with zeros to a whole number of rows, so the rows of
every parameter lie at the same place in the copy whatever DDP's order in the bucket: one reduction over the last
dimension of ``(rows, ROW)`` then sums each row alike on every layout (the same shape, the same kernel, the same
order inside a row), and any fixed-order sum of the rows is bit for bit the same on every layout.
"""
from __future__ import annotations

import torch

from gcomp.bucket import BucketInfo


class AlignedRows:
    """One bucket layout's parameters (a tensor the layout does not describe is one parameter) as rows of
    ``row`` entries, in the order of the parameters' names: ``rows`` per parameter, ``total`` in all, ``pads`` zeros
    closing each parameter's last row. ``to_bucket`` takes a per-parameter tensor in name order back to bucket
    order. The zero pads are views made once per dtype, device and leading shape, then reused. The copy holds at
    most ``row - 1`` zeros per parameter: a bucket of many small parameters is summed over several times its size
    (still one kernel each)."""

    def __init__(self, bucket: BucketInfo, n: int, row: int):
        segments = list(bucket.segments()) if bucket.numel == n and bucket.numels else [("", 0, n)]
        self.row, self.sizes = row, [k for _, _, k in segments]
        self.order = sorted(range(len(segments)), key=lambda j: segments[j])  # as ``row_plan``: by name
        numels = [self.sizes[j] for j in self.order]
        self.rows = tuple(-(-k // row) for k in numels)
        self.pads = [r * row - k for r, k in zip(self.rows, numels)]
        self.total = sum(self.rows)
        self.numels = numels
        self._back = [0] * len(segments)
        for place, j in enumerate(self.order):
            self._back[j] = place
        self._zeros: dict[tuple, list] = {}
        self._tensors: dict[tuple, torch.Tensor] = {}

    def constant(self, what: str, device, dtype=torch.float64) -> torch.Tensor:
        """``"numels"``, ``"pads"`` (name order) or ``"back"`` (bucket to name order) as a tensor on ``device``,
        kept."""
        key = (what, str(device), dtype)
        found = self._tensors.get(key)
        if found is None:
            values = {"numels": self.numels, "pads": self.pads, "back": self._back}[what]
            found = self._tensors[key] = torch.tensor(values, dtype=dtype).to(device)
        return found

    def to_bucket(self, per_parameter: torch.Tensor) -> torch.Tensor:
        """A tensor of one value per parameter along its last dimension, from name order to bucket order."""
        return per_parameter.index_select(-1, self.constant("back", per_parameter.device, torch.int64))

    def _pads(self, x: torch.Tensor) -> list:
        key = (x.dtype, str(x.device), tuple(x.shape[:-1]))
        pads = self._zeros.get(key)
        if pads is None:
            zeros = torch.zeros(*x.shape[:-1], max(self.pads, default=0), dtype=x.dtype, device=x.device)
            pads = self._zeros[key] = [zeros[..., :p] if p else None for p in self.pads]
        return pads

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (``(..., n)``, in bucket order) copied as ``(..., total, row)``: parameters in name order, each
        from the start of a row, its last row closed by zeros."""
        pieces = x.split(self.sizes, dim=-1)
        parts = []
        for j, pad in zip(self.order, self._pads(x)):
            if self.sizes[j]:
                parts.append(pieces[j])
            if pad is not None:
                parts.append(pad)
        return torch.cat(parts, dim=-1).view(*x.shape[:-1], self.total, self.row)
