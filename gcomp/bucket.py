"""The layout of one flat gradient bucket (``BucketInfo``: where each parameter's entries lie), and per-parameter
work over it in a fixed number of operations whatever the number of parameters (``segment_reduce``, ``expand``)."""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable

import torch

INT32_LIMIT = 2**31 - 1  # positions into a bucket travel as int32 up to here, as int64 past it


def index_dtype(length: int) -> torch.dtype:
    """The dtype of positions into ``length`` entries: int32, int64 past 2**31 entries."""
    return torch.int32 if length <= INT32_LIMIT else torch.int64


@dataclass(frozen=True)
class BucketInfo:
    """Where each parameter's gradient lies inside a flat bucket buffer.

    ``key`` identifies the layout, not only the bucket index: DDP rebuilds its buckets after the first
    iteration (after the second with ``static_graph=True``), so per-bucket state is keyed by index, dtype,
    size and the names of the parameters it holds, and a changed layout shows up as a new key.
    """

    key: str
    index: int
    numel: int
    dtype: torch.dtype
    names: tuple[str, ...]
    offsets: tuple[int, ...]
    numels: tuple[int, ...]

    @classmethod
    def from_layout(cls, index: int, dtype: torch.dtype, names, numels) -> "BucketInfo":
        names, numels = tuple(names), tuple(int(n) for n in numels)
        offsets, total = [], 0
        for n in numels:
            offsets.append(total)
            total += n
        digest = zlib.crc32("\0".join(names).encode())
        key = f"b{index}:{str(dtype).removeprefix('torch.')}:{total}:{digest:08x}"
        return cls(key, index, total, dtype, names, tuple(offsets), numels)

    @classmethod
    def single(cls, tensor: torch.Tensor, name: str = "tensor", index: int = 0) -> "BucketInfo":
        """A one-parameter layout for a bare tensor (tests, benchmarks, use outside DDP)."""
        return cls.from_layout(index, tensor.dtype, [name], [tensor.numel()])

    def segments(self):
        """(name, offset, numel) of each parameter, in buffer order."""
        return zip(self.names, self.offsets, self.numels)


# --- per-parameter work: one operation for every segment (parameter) of a flat bucket ----------------------------

_LENGTHS: dict[tuple, torch.Tensor] = {}


def lengths_tensor(lengths: tuple[int, ...], device: torch.device, rows: int = 0) -> torch.Tensor:
    """``lengths`` as an int64 tensor on ``device`` (``rows`` > 0: repeated for that many rows, as
    ``segment_reduce`` wants for a 2-D input), kept for the next call with the same layout."""
    key = (lengths, str(device), rows)
    found = _LENGTHS.get(key)
    if found is None:
        found = torch.tensor(lengths, dtype=torch.int64).to(device)
        if rows:
            found = found.expand(rows, len(lengths)).contiguous()
        _LENGTHS[key] = found
    return found


def expand(per_segment: torch.Tensor, lengths: tuple[int, ...], n: int) -> torch.Tensor:
    """One value per segment (along the last dimension) repeated over its segment's entries: ``n`` of them."""
    return torch.repeat_interleave(per_segment, lengths_tensor(lengths, per_segment.device), dim=-1,
                                   output_size=n)


def segment_reduce(values: torch.Tensor, lengths: tuple[int, ...], how: str, initial: float | None = None) -> torch.Tensor:
    """``how`` (``"sum"``, ``"max"``, ``"min"``, ``"mean"``) of each segment along the last dimension of ``values``
    (1-D, or 2-D: each row alike); NaN propagates; an empty segment gives ``initial`` (0 for a sum)."""
    rows = values.shape[0] if values.dim() == 2 else 0
    kwargs = {} if initial is None else {"initial": initial}
    # unsafe: the lengths are the layout's (none negative, their sum the segments' total), so segment_reduce need
    # not check them on the host, which is two synchronisations a call on a device
    return torch.segment_reduce(values, how, lengths=lengths_tensor(lengths, values.device, rows), axis=values.dim() - 1,
                                unsafe=True, **kwargs)


def per_segment_(x: torch.Tensor, scales: torch.Tensor, lengths: tuple[int, ...],
                 op: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``op(x, each entry's segment scale)`` in place, over every segment at once: ``op`` takes the whole tensor and
    a tensor of its shape."""
    op(x, expand(scales, lengths, x.shape[-1]))
    return x


def segment_scales(values: torch.Tensor, lengths: tuple[int, ...], clip: float = 0.0,
                   magnitudes: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """max |value| per segment, capped at ``clip * std`` (std about the mean) where that cap is positive; 0 for an
    empty segment, NaN where a segment holds one."""
    mags = values.abs() if magnitudes is None else magnitudes[:values.shape[-1]]
    scales = segment_reduce(mags, lengths, "max", initial=0.0)
    if clip > 0:
        counts = lengths_tensor(lengths, values.device).to(values.dtype).clamp_(min=1)
        mean = segment_reduce(values, lengths, "sum") / counts
        centred = values - expand(mean, lengths, values.shape[-1])
        cap = clip * (segment_reduce(centred.mul_(centred), lengths, "sum") / counts).sqrt_()
        scales = torch.where(cap > 0, torch.minimum(scales, cap), scales)
    if out is None:
        return scales
    return out.copy_(scales)
