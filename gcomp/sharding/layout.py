"""Where each parameter's gradient lies in FSDP2's flat reduce-scatter input (its rows: one per destination shard).

FSDP2 (``foreach_reduce``) pads every gradient along dim 0 to a multiple of the shard count, cuts it into that
many equal chunks, and lays the chunks out shard-major: row r of ``input.view(world, -1)`` is chunk r of every
parameter, in the group's parameter order; rank r's output shard is the reduced row r. Only parameters that
received a gradient are in it (``gcomp.fsdp.comm`` refuses an input whose size says otherwise).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

from gcomp.bucket import BucketInfo


@dataclass(frozen=True)
class ShardLayout:
    """The reduce-scatter input of one FSDP parameter group on ``world`` shards: ``names`` (parameter names in
    the model, FSDP's order) and their unsharded ``sizes``."""

    index: int  # the FSDP module's place among the model's FSDP modules
    names: tuple[str, ...]
    sizes: tuple[torch.Size, ...]
    world: int
    rank: int
    dtype: torch.dtype

    @cached_property
    def chunks(self) -> tuple[int, ...]:
        """Entries of each parameter in one row (its dim 0 padded to a multiple of ``world``, divided by it)."""
        out = []
        for size in self.sizes:
            rows = -(-size[0] // self.world) if len(size) else 1
            out.append(rows * math.prod(size[1:]))
        return tuple(out)

    @property
    def shard_numel(self) -> int:
        return sum(self.chunks)

    @property
    def numel(self) -> int:
        return self.world * self.shard_numel

    @cached_property
    def pieces(self) -> BucketInfo:
        """The input as a gcomp bucket: one segment per (parameter, shard), named ``"<name>[<shard>]"``, in the
        input's own shard-major order (per-parameter state such as residuals is kept and saved by these)."""
        names = [f"{n}[{r}]" for r in range(self.world) for n in self.names]
        return BucketInfo.from_layout(self.index, self.dtype, names, self.chunks * self.world)

    @cached_property
    def params(self) -> BucketInfo:
        """The input as one segment per parameter (padded size), named as in the model: what the mask tracker
        reads masks by. Its segments are not where the entries lie (``shard_major`` says where)."""
        return BucketInfo.from_layout(self.index, self.dtype, self.names, [c * self.world for c in self.chunks])

    @cached_property
    def own(self) -> BucketInfo:
        """This rank's output shard as a bucket, one segment per parameter (``"<name>[<rank>]"``)."""
        return BucketInfo.from_layout(self.index, self.dtype, [f"{n}[{self.rank}]" for n in self.names],
                                      self.chunks)

    def shard_major(self, tensors: list[torch.Tensor | None], fill, pad, dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
        """Per-parameter tensors of the unsharded sizes (None: ``fill`` throughout) laid out as the input is,
        ``(world, shard_numel)``, FSDP's dim-0 padding set to ``pad``."""
        out = torch.full((self.world, self.shard_numel), pad, dtype=dtype, device=device)
        at = 0
        for size, chunk, t in zip(self.sizes, self.chunks, tensors):
            rows = -(-size[0] // self.world) if len(size) else 1
            padded = torch.full((rows * self.world, *size[1:]), pad, dtype=dtype, device=device)
            padded[:size[0] if len(size) else 1] = fill if t is None else t.reshape(size).to(dtype)
            out[:, at:at + chunk] = padded.reshape(self.world, chunk)
            at += chunk
        return out
