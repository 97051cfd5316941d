"""``terngrad``'s device path (``gcomp.kernels.on_device``): the wire of the CPU path, each step a fixed number of
whole-bucket operations whatever the bucket's parameters and entries, and no host read.

The encode is the CPU path's with its two per-bucket loops gone: the scales are segment reductions
(``quantise.segment_scales``), each scale reaches its entries by one ``segments.expand`` (``quantise.per_segment_``),
and the hits are one uniform per entry from the method's stream on the bucket's device
(``bernoulli.draw_hits_device``) instead of a random byte refined where it ties. The all-reduce form's lanes are
packed and unpacked by ``bitpack_device`` (a few operations for any lane width). The decodes here loop over ranks (the
world, not the bucket): per rank, every byte of the codes gives its 4 values of ``t`` in one gather through the
code table, and the scales multiply them into the sum in one ``addcmul``.
"""
from __future__ import annotations

import torch

from gcomp.collectives import bitpack
from gcomp.collectives import bitpack_device
from gcomp.kernels import segments

_TABLES: dict[tuple[str, torch.dtype], torch.Tensor] = {}


def code_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``(256, 4)`` of ``dtype``: entry ``[v, j]`` is ``t = code - 1`` of the 2-bit field j of the byte v (kept per
    device and dtype)."""
    key = (str(device), dtype)
    table = _TABLES.get(key)
    if table is None:
        fields = torch.arange(256)[:, None].bitwise_right_shift(2 * torch.arange(4)).bitwise_and_(3).sub_(1)
        table = _TABLES[key] = fields.to(dtype).to(device)
    return table


def decode_codes(scales: torch.Tensor, words: torch.Tensor, n: int, lengths: tuple[int, ...], total: torch.Tensor,
                 space: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The sum over ranks of ``(code - 1) * scale`` written into ``total`` (flat, the work dtype). ``scales``:
    ``(world, segments)``; ``words``: ``(world, words)`` of 2-bit codes; ``space``: a work buffer of the fields of a
    row (``words.shape[1] * 32``); ``index``: an int32 buffer of a row's bytes (``words.shape[1] * 8``)."""
    table = code_table(words.device, total.dtype)
    units = scales.to(total.dtype)
    rows = -(-n // 4)  # the bytes that hold the n codes
    for rank in range(words.shape[0]):  # a loop over ranks, not entries
        codes = bitpack_device.table_decode(words[rank], rows, table, space, index)[:n]
        scale = segments.expand(units[rank], lengths, n)
        if rank:
            total.addcmul_(codes, scale)
        else:
            torch.mul(codes, scale, out=total)
    return total


def decode_lanes(shared: torch.Tensor, lanes: torch.Tensor, n: int, lengths: tuple[int, ...], world: int, bits: int,
                 total: torch.Tensor) -> torch.Tensor:
    """``(field - world) * shared scale`` of the summed ``lanes`` written into ``total`` (flat, the work dtype);
    ``shared``: the MAX-reduced scales, then the non-finite flag (NaN everywhere where it is set)."""
    bitpack_device.unpack(lanes, n, bits, out=total).sub_(world)
    scale = shared[:-1].to(total.dtype) + torch.where(shared[-1] > 0, torch.nan, 0.0).to(total.dtype)
    return total.mul_(segments.expand(scale, lengths, n))
