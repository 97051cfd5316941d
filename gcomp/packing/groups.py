"""The support of a structurally pruned bucket: whole filters or channels, copied as blocks, with no entry index.

A filter (output channel, dim 0 of a Conv or Linear weight) is one contiguous run of the bucket, in the
contiguous and the channels_last layouts alike; an input channel (dim 1) is a run per filter and kernel
position. So each parameter's kept entries are gathered with one ``index_select`` along its group dimension,
indexed by kept *group* (one integer per filter), never by entry. The packed vector holds each parameter's
kept groups in logical order, parameter after parameter, in bucket order.

On the device path (``gcomp.kernels.on_device``) a loop over parameters is a launch or two each: there the
support packs through one int32 index of every kept position instead (``gcomp.packing.positions``), made at its
first device-path call: 4 bytes per kept entry, the price of one ``index_select`` per bucket.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from gcomp.kernels import on_device
from gcomp.packing.positions import gather_at, kept_positions, scatter_at
from gcomp.packing.support import Support
from gcomp.pruning.masks import positions_digest


@dataclass(frozen=True)
class _Piece:
    start: int  # the parameter's slice of the bucket
    numel: int
    size: torch.Size  # its logical shape, laid out in the bucket with ``stride``
    stride: tuple[int, ...]
    at: int  # where its kept entries start in the packed vector
    kept: int
    dim: int | None = None  # the group dimension; None: the parameter is kept whole
    keep: torch.Tensor | None = None  # int64 indices of the kept groups along ``dim``
    drop: torch.Tensor | None = None  # int64 indices of the pruned groups

    def view(self, bucket: torch.Tensor) -> torch.Tensor:
        return bucket[self.start:self.start + self.numel].as_strided(self.size, self.stride)

    def packed_shape(self) -> list[int]:
        shape = list(self.size)
        shape[self.dim] = self.keep.numel()
        return shape


def group_dim(mask: torch.Tensor) -> tuple[int, torch.Tensor]:
    """The dimension whose kept groups (a group: a slice ``[..., i, ...]`` with any nonzero mask entry)
    cover the fewest entries, and those groups as a bool vector. Ties go to the lower dimension (filters)."""
    nonzero = mask != 0
    best = None
    for d in range(nonzero.dim()):
        others = [i for i in range(nonzero.dim()) if i != d]
        groups = nonzero.any(dim=others) if others else nonzero
        volume = int(groups.sum()) * (nonzero.numel() // max(nonzero.size(d), 1))
        if best is None or volume < best[0]:
            best = (volume, d, groups)
    return best[1], best[2]


class GroupSupport(Support):
    """Which filters or channels of a bucket's parameters are kept; gathers and scatters them as blocks.

    Built from the same ``(size, stride, mask or None)`` list as :func:`gcomp.packing.support.bucket_support`.
    Each masked parameter is kept by whole groups along the dimension :func:`group_dim` picks: for a mask that
    prunes whole filters (or channels) the kept entries are exactly the mask's; for an unstructured mask, every
    group with a kept entry goes whole (its pruned entries travel as zeros). Unmasked parameters go whole.
    The interface is :class:`gcomp.packing.support.Support`.
    """

    def __init__(self, params: list[tuple[torch.Size, tuple[int, ...], torch.Tensor | None]], numel: int,
                 device: torch.device | str = "cpu"):
        pieces, start, at = [], 0, 0
        support = torch.ones(numel, dtype=torch.bool, device=device)  # only for the digest
        for size, stride, mask in params:
            size, n = torch.Size(size), torch.Size(size).numel()
            if mask is None or n == 0 or bool((mask != 0).all()):
                pieces.append(_Piece(start, n, size, tuple(stride), at, n))
            else:
                dim, groups = group_dim(mask.reshape(size).to(device))
                keep, drop = groups.nonzero().reshape(-1), (~groups).nonzero().reshape(-1)
                kept = keep.numel() * (n // size[dim])
                piece = _Piece(start, n, size, tuple(stride), at, kept, dim, keep, drop)
                piece.view(support).index_fill_(dim, drop, False)
                pieces.append(piece)
            start += n
            at += pieces[-1].kept
        if start != numel:
            raise ValueError(f"the parameters cover {start} entries of a bucket of {numel}")
        self.pieces = pieces
        self.numel = numel
        self.segments: tuple[int, ...] = tuple(p.kept for p in pieces)
        self.kept = at
        self.digest = positions_digest(support.nonzero().reshape(-1))

    @property
    def index_bytes(self) -> int:
        """Memory the group indices hold (8 bytes per filter or channel, none per entry), and once made the device
        path's ``positions`` (4 bytes per kept entry)."""
        groups = sum(p.keep.numel() * 8 + p.drop.numel() * 8 for p in self.pieces if p.dim is not None)
        return groups + (4 * self.kept if "positions" in vars(self) else 0)

    @cached_property
    def positions(self) -> torch.Tensor:
        """int32, every kept position in packed order: the device path's index (made when first needed)."""
        return kept_positions(self._gather, self.numel, self.kept, self.digest.device)

    def gather(self, bucket: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out[:kept]`` = the kept groups of ``bucket``, parameter by parameter (``out`` may be longer)."""
        if on_device(bucket):
            return gather_at(self.positions, bucket, out)
        return self._gather(bucket, out)

    def _gather(self, bucket: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        for p in self.pieces:
            if p.dim is None:
                out[p.at:p.at + p.kept].view(p.size).copy_(p.view(bucket))
            elif p.kept:
                torch.index_select(p.view(bucket), p.dim, p.keep, out=out[p.at:p.at + p.kept].view(p.packed_shape()))
        return out

    def scatter(self, packed: torch.Tensor, bucket: torch.Tensor) -> torch.Tensor:
        """Write ``packed[:kept]`` onto the kept groups of ``bucket`` and zero the pruned ones."""
        if on_device(bucket):
            return scatter_at(self.positions, packed, bucket)
        for p in self.pieces:
            view = p.view(bucket)
            if p.dim is None:
                view.copy_(packed[p.at:p.at + p.kept].view(p.size))
                continue
            if p.kept:
                view.index_copy_(p.dim, p.keep, packed[p.at:p.at + p.kept].view(p.packed_shape()))
            if p.drop.numel():
                view.index_fill_(p.dim, p.drop, 0)
        return bucket
