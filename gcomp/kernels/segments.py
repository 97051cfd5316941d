"""Per-parameter work over a flat bucket on the device path: one kernel for all segments, whatever their number.

A bucket's parameters are its segments (``lengths``, in entries). On the CPU a loop over them is fastest and needs
no index as large as the bucket; on a device each loop turn is a launch, so here every segment is reduced by one
``torch.segment_reduce`` and a per-segment value reaches its entries by one ``repeat_interleave`` with its output
size given (no host read of the lengths). The lengths' tensor is made once per layout and device.
"""
from __future__ import annotations

from typing import Callable

import torch

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


def reduce(values: torch.Tensor, lengths: tuple[int, ...], how: str, initial: float | None = None) -> torch.Tensor:
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
    """``op(x, each entry's segment scale)`` in place, over every segment at once (the device path of
    ``gcomp.compressors.quantise.per_segment_``): ``op`` takes the whole tensor and a tensor of its shape."""
    op(x, expand(scales, lengths, x.shape[-1]))
    return x


def segment_scales(values: torch.Tensor, lengths: tuple[int, ...], clip: float = 0.0,
                   magnitudes: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """max |value| per segment, capped at ``clip * std`` (std about the mean) where that cap is positive; 0 for an
    empty segment, NaN where a segment holds one (the device path of ``quantise.segment_scales``)."""
    mags = values.abs() if magnitudes is None else magnitudes[:values.shape[-1]]
    scales = reduce(mags, lengths, "max", initial=0.0)
    if clip > 0:
        counts = lengths_tensor(lengths, values.device).to(values.dtype).clamp_(min=1)
        mean = reduce(values, lengths, "sum") / counts
        centred = values - expand(mean, lengths, values.shape[-1])
        cap = clip * (reduce(centred.mul_(centred), lengths, "sum") / counts).sqrt_()
        scales = torch.where(cap > 0, torch.minimum(scales, cap), scales)
    if out is None:
        return scales
    return out.copy_(scales)
