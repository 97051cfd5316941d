"""``qsgd``'s device path (``gcomp.kernels.on_device``): the wire of the CPU path (fp32 norms per parameter, the
fields ``sign(g) l + s``), each step a fixed number of whole-bucket operations whatever the bucket's parameters and
entries, and no host read.

The norms are one sum of squares per parameter (``gcomp.kernels.segments.reduce``) instead of a ``vector_norm``
per parameter: the same value up to the order of the sum. Each factor ``s / r`` reaches its parameter's entries by
one ``segments.expand``, so the stochastic rounding is one ``addcmul`` over the bucket against the same draws
(``quantise.draw_units``, from the method's stream on the bucket's device). The decode loops over ranks (the
world, not the bucket): per rank, the fields become levels in one conversion and one subtraction, and are scaled
and summed in one ``addcmul``; fields narrower or wider than a byte go through ``bitpack_device``.
"""
from __future__ import annotations

import torch

from gcomp.collectives import bitpack_device
from gcomp.compressors.quantise import draw_units, wire_scale
from gcomp.kernels import segments


def norms(values: torch.Tensor, lengths: tuple[int, ...]) -> torch.Tensor:
    """The L2 norm of each segment of the flat ``values``, in their dtype (0 for an empty segment)."""
    return segments.reduce(values * values, lengths, "sum").sqrt_()


def signed_levels(values: torch.Tensor, lengths: tuple[int, ...], levels: int, words: torch.Tensor,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The wire norms (fp32) and ``sign(g) l + 1`` per entry, as the CPU path draws them: ``floor(s g / r + w)``
    with ``w`` uniform on [1, 2) (``draw_units`` into ``words``, the draws buffer, which the result is a view of)."""
    n, work = values.numel(), values.dtype
    wire = wire_scale(norms(values, lengths))
    # a zero parameter (0 / 0) scales by 0 instead: level 0; so does a non-finite norm (its decode is NaN)
    factors = torch.where(wire > 0, levels / wire, 0.0).to(work)
    draws = draw_units(words, n, work, generator)
    return wire, draws.addcmul_(values, segments.expand(factors, lengths, n)).floor_()


def decode(norms: torch.Tensor, words: torch.Tensor, n: int, lengths: tuple[int, ...], levels: int, bits: int,
           byte_words: bool, total: torch.Tensor, space: torch.Tensor) -> torch.Tensor:
    """The sum over ranks of ``(field - s) * r / s`` written into ``total`` (flat, the work dtype); ``space`` is a
    work buffer of that dtype holding at least the fields of ``words``' row padded to whole words."""
    units = norms.to(total.dtype) / levels  # (world, segments): every rank's at once
    for rank in range(words.shape[0]):  # a loop over ranks, not entries
        target = total if rank == 0 else space[:n]
        if bits == 8 and byte_words:  # 8-bit fields are the words' own bytes
            target.copy_(words[rank].view(torch.uint8)[:n])
        else:
            bitpack_device.unpack(words[rank], n, bits, out=target)
        target.sub_(levels)  # the signed level, exact in the work dtype
        scale = segments.expand(units[rank], lengths, n)
        if rank:
            total.addcmul_(target, scale)
        else:
            total.mul_(scale)
    return total
