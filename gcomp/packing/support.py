"""The support of a bucket (the entries its masks keep) and the fast gather/scatter that packs it densely."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cached_property

import torch

from gcomp.bucket import INT32_LIMIT
from gcomp.kernels import on_device
from gcomp.packing.positions import gather_at, kept_positions, scatter_at
from gcomp.pruning.masks import positions_digest

_SAME_WIDTH_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}

# Kept runs at least this long are copied as slices; shorter ones go through one int32 position index.
MIN_RUN = 256


@dataclass(frozen=True)
class _Slice:
    start: int  # in the bucket
    stop: int
    at: int  # in the packed vector


@dataclass(frozen=True)
class _Scattered:
    start: int  # the bucket region [start, stop) this piece owns: zeroed, then its kept entries written
    stop: int
    at: int  # in the packed vector
    positions: torch.Tensor  # int32, absolute in the bucket, increasing


class Support(ABC):
    """What a bucket keeps, and how it is packed: the interface the mask tracker and the packing codecs use.

    ``numel`` is the bucket's length, ``kept`` the packed vector's; ``segments`` the kept count of each
    parameter, in bucket order (each parameter's kept entries are one contiguous segment of the packed
    vector: per-parameter scales rely on it); ``digest`` an int64 (hash, count) of the kept positions, equal
    on every rank that keeps the same entries; ``index_bytes`` the memory its index holds.
    """

    numel: int
    kept: int
    segments: tuple[int, ...]
    digest: torch.Tensor

    @property
    @abstractmethod
    def index_bytes(self) -> int:
        """Memory the packing index holds, in bytes."""

    @abstractmethod
    def gather(self, bucket: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out[:kept]`` = the kept entries of ``bucket`` (``out`` may be longer); returns ``out``."""

    @abstractmethod
    def scatter(self, packed: torch.Tensor, bucket: torch.Tensor) -> torch.Tensor:
        """Write ``packed[:kept]`` onto the kept entries of ``bucket``, zero every other entry; returns it."""


class SupportIndex(Support):
    """Which entries of a flat bucket are kept, as contiguous slices plus one int32 index for the rest.

    The packed vector lists the kept entries in bucket order, so each parameter's kept entries form one
    contiguous segment of it (``segments``), which is what per-parameter ternary scales need. The index
    costs 4 bytes per kept entry outside long runs: at most half an fp32 bucket when half is pruned.

    On the device path (``gcomp.kernels.on_device``) gather and scatter take one int32 index of every kept
    position instead (``positions``, ``gcomp.packing.positions``): 4 bytes per kept entry, long runs included.
    A support built on the device path makes only that index (its slices, ``pieces``, are made if ever asked
    for); one built on the CPU makes its pieces, and the index at its first device-path call.
    """

    def __init__(self, support: torch.Tensor, numels: tuple[int, ...], min_run: int = MIN_RUN):
        if support.dtype != torch.bool or support.dim() != 1 or support.numel() != sum(numels):
            raise ValueError("support must be a flat bool tensor as long as the bucket")
        n = support.numel()
        if n > INT32_LIMIT:
            raise ValueError(f"a bucket of {n} entries is too large for int32 positions")
        self.numel = n
        kept_per_param = torch.stack([s.sum() for s in support.split(list(numels))]) if numels else \
            torch.zeros(0, dtype=torch.int64)
        self.segments: tuple[int, ...] = tuple(kept_per_param.tolist())
        self.kept = sum(self.segments)
        kept = support.nonzero().reshape(-1)
        self.digest = positions_digest(kept)
        self.min_run = min_run
        if on_device(support):
            self.positions = kept.to(torch.int32)
        else:
            self.pieces = self._pieces(support, min_run)

    @cached_property
    def pieces(self) -> list:
        """The slices and scattered positions of the CPU path (made from ``positions`` when first needed)."""
        support = torch.zeros(self.numel, dtype=torch.bool, device=self.positions.device)
        return self._pieces(support.index_fill_(0, self.positions.long(), True), self.min_run)

    @cached_property
    def positions(self) -> torch.Tensor:
        """int32, every kept position in bucket order: the device path's index (made when first needed)."""
        device = next((p.positions.device for p in self.pieces if isinstance(p, _Scattered)), self.digest.device)
        return kept_positions(self._gather, self.numel, self.kept, device)

    @staticmethod
    def _pieces(support: torch.Tensor, min_run: int) -> list:
        edges = torch.diff(torch.nn.functional.pad(support.to(torch.int8), (1, 1)))
        starts = (edges == 1).nonzero().reshape(-1)
        stops = (edges == -1).nonzero().reshape(-1)
        long = (stops - starts) >= min_run
        runs = list(zip(starts[long].tolist(), stops[long].tolist()))
        pieces, at, cursor = [], 0, 0
        for start, stop in runs + [(support.numel(), support.numel())]:
            if start > cursor:  # the region between two long runs: its kept entries go by position
                positions = (support[cursor:start].nonzero().reshape(-1) + cursor).to(torch.int32)
                pieces.append(_Scattered(cursor, start, at, positions))
                at += positions.numel()
            if stop > start:
                pieces.append(_Slice(start, stop, at))
                at += stop - start
            cursor = stop
        return pieces

    @property
    def index_bytes(self) -> int:
        """Memory the packing indices made so far hold (int32 positions; slices cost nothing)."""
        made = vars(self)
        pieces = sum(p.positions.numel() * 4 for p in made.get("pieces", ()) if isinstance(p, _Scattered))
        return pieces + (4 * self.kept if "positions" in made else 0)

    def gather(self, bucket: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out[:kept]`` = the kept entries of ``bucket``, in bucket order (``out`` may be longer)."""
        if on_device(bucket):
            return gather_at(self.positions, bucket, out)
        return self._gather(bucket, out)

    def _gather(self, bucket: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        for p in self.pieces:
            if isinstance(p, _Slice):
                out[p.at:p.at + p.stop - p.start].copy_(bucket[p.start:p.stop])
            elif p.positions.numel():
                torch.index_select(bucket, 0, p.positions, out=out[p.at:p.at + p.positions.numel()])
        return out

    def scatter(self, packed: torch.Tensor, bucket: torch.Tensor) -> torch.Tensor:
        """Write ``packed[:kept]`` onto the kept entries of ``bucket`` and zero every other entry."""
        if on_device(bucket):
            return scatter_at(self.positions, packed, bucket)
        # index_add_ onto zeros is a copy that takes int32 positions (index_copy_ wants int64). Adding the
        # bits as integers of the same width is exact too, and fp16's index_add_ is some 7x slower than int16's.
        ints = _SAME_WIDTH_INT.get(bucket.element_size())
        bucket_bits, packed_bits = (bucket, packed) if ints is None or packed.dtype != bucket.dtype else \
            (bucket.view(ints), packed.view(ints))
        for p in self.pieces:
            if isinstance(p, _Slice):
                bucket[p.start:p.stop].copy_(packed[p.at:p.at + p.stop - p.start])
            else:
                bucket[p.start:p.stop].zero_()
                bucket_bits.index_add_(0, p.positions, packed_bits[p.at:p.at + p.positions.numel()])
        return bucket


def bucket_support(params: list[tuple[torch.Size, tuple[int, ...], torch.Tensor | None]], numel: int,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """The flat bool support of a bucket from its parameters' masks.

    ``params`` lists, in bucket order, each parameter's size, strides and mask (None: kept entirely). DDP lays
    each gradient into the bucket with the parameter's own strides (channels_last included), so each mask is
    written through a strided view of its slice of the bucket, not flattened in logical order.
    """
    support = torch.ones(numel, dtype=torch.bool, device=device)
    offset = 0
    for size, stride, mask in params:
        n = size.numel()
        if mask is not None:
            support[offset:offset + n].as_strided(size, stride).copy_(mask != 0)
        offset += n
    if offset != numel:
        raise ValueError(f"the parameters cover {offset} entries of a bucket of {numel}")
    return support
