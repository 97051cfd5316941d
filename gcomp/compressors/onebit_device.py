"""The device path of ``onebit``: both means of every parameter by one reduction over the bucket's rows and one
segment sum of the rows, the bits packed in one pass, and the decodes (one rank's, and the sum over every rank's)
through per-parameter byte tables in one kernel for the whole bucket (``sign_device``). The wire is the CPU
path's (``gcomp.compressors.onebit``): bits, then every parameter's mean of bit 0, then every one's mean of bit 1.
"""
from __future__ import annotations

import torch

from gcomp.collectives import bitpack
from gcomp.compressors import sign_device
from gcomp.compressors.sign_rows import AlignedRows
from gcomp.kernels import segments


class DeviceLayout:
    """What the device path keeps per bucket layout and device: the layout-free rows (``AlignedRows``) and, for the
    decode, the CPU path's byte classes (``onebit._Layout``: ``classes``, ``(C, 8)``, the parameter of each bit
    position of each class; ``base``, int32 class * 256 per byte, None for one parameter), built on the host once
    and copied to the device."""

    def __init__(self, host_layout, rows: AlignedRows, device):
        self.rows = rows
        self.classes = host_layout.classes.contiguous().to(device)
        self.base = None if host_layout.base is None else host_layout.base.to(device)


def encode(x: torch.Tensor, layout: DeviceLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """``x``'s sign bits (``sign_device.pack_signs``) and its ``2 * parts`` fp32 means, as the CPU path: each side of
    a parameter summed in rows of ``ROW`` from the parameter's start (fp32, fp64 for fp64), the rows added in fp64,
    divided by the side's count and rounded once; NaN is counted with bit 0, whose mean it makes NaN."""
    rows, flat = layout.rows, x.reshape(-1)
    work = torch.promote_types(x.dtype, torch.float32)
    y = rows.gather(flat)  # (rows, ROW), padded with zeros: they count as bit 1 and are taken off below
    plus = torch.ge(y, 0)
    sums = torch.empty(3, rows.total, dtype=work, device=x.device)
    torch.sum(torch.clamp(y, max=0), -1, dtype=work, out=sums[0])  # NaN stays NaN: it lands in bit 0's side
    torch.nansum(torch.clamp(y, min=0), -1, dtype=work, out=sums[1])  # (and is skipped in bit 1's)
    torch.sum(plus, -1, dtype=work, out=sums[2])
    per = segments.reduce(sums.to(torch.float64), rows.rows, "sum", initial=0.0)  # (3, parts), name order
    ones = per[2].sub_(rows.constant("pads", x.device))
    counts = torch.stack([rows.constant("numels", x.device) - ones, ones]).clamp_(min=1)
    means = rows.to_bucket(per[:2].div_(counts)).to(torch.float32).reshape(-1)
    return sign_device.pack_signs(flat), means


def _tables(means: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
    """``means`` (``(..., 2 * parts)``) as ``(..., C, 256, 8)`` byte tables of the ``classes``."""
    per = means.reshape(*means.shape[:-1], 2, -1).index_select(-1, classes.reshape(-1))
    per = per.view(*per.shape[:-1], classes.shape[0], 1, 8)
    return bitpack.bit_table(per[..., 0, :, :, :], per[..., 1, :, :, :])


def decode(words: torch.Tensor, means: torch.Tensor, layout, n: int, dtype: torch.dtype) -> torch.Tensor:
    """One rank's payload decoded: each entry its side's mean in its parameter (``dtype``, ``n`` entries)."""
    table = _tables(means, layout.classes).to(dtype)
    return sign_device.decode_one(words, n, table.view(-1, 8), layout.base)


def aggregate(words: torch.Tensor, means: torch.Tensor, layout, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The fp32 sum, in rank order, of every rank's decode (``(world, words)``, ``(world, 2 * parts)``)."""
    if words.shape[0] == 1:
        return decode(words[0], means[0], layout, n, dtype)
    total = sign_device.sum_decodes(words, n, lambda a, b: _tables(means[a:b], layout.classes),
                                    classes=layout.classes.shape[0], base=layout.base)
    return total.to(dtype)
