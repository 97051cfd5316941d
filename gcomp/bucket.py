"""The layout of one DDP gradient bucket, as the hook and the methods see it."""
from __future__ import annotations

import zlib
from dataclasses import dataclass

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
