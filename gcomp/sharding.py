"""FSDP2's reduce-scatter input as rows, one per destination shard (``ShardLayout``), and a method's per-parameter
state moved onto another number of shards (``reshard_parameters``).

FSDP2 pads every gradient's dim 0 to a multiple of the shard count and lays the chunks out shard-major: row r of
``input.view(world, -1)`` is chunk r of every parameter that received a gradient, and rank r's output is the
reduced row r. Per-parameter state is keyed by piece, ``"<parameter>[<shard>]"``; a resize joins a parameter's
pieces, drops FSDP's padding (its gradient is zero: nothing is held back there) and cuts them again.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property, lru_cache

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
        """The input as a bucket: one segment per (parameter, shard), ``"<name>[<shard>]"``, shard-major."""
        names = [f"{n}[{r}]" for r in range(self.world) for n in self.names]
        return BucketInfo.from_layout(self.index, self.dtype, names, self.chunks * self.world)

    @cached_property
    def params(self) -> BucketInfo:
        """One segment per parameter (padded size), named as in the model (masks are read by these); not where the
        entries lie (``shard_major`` says where)."""
        return BucketInfo.from_layout(self.index, self.dtype, self.names, [c * self.world for c in self.chunks])

    @cached_property
    def own(self) -> BucketInfo:
        """This rank's output shard as a bucket, one segment per parameter (``"<name>[<rank>]"``)."""
        return self.row(self.rank)

    def row(self, r: int) -> BucketInfo:
        """Row ``r`` of the input (what shard r receives) as a bucket, one segment per parameter."""
        return _row(self, r)

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


@lru_cache(maxsize=None)
def _row(layout: ShardLayout, r: int) -> BucketInfo:
    return BucketInfo.from_layout(layout.index, layout.dtype, [f"{n}[{r}]" for n in layout.names], layout.chunks)


def reshard_parameters(method, state: dict, sizes: dict[str, torch.Size], saved: int, world: int,
                       where: str) -> None:
    """Move one old rank's per-parameter state (``method.parameter_state``), in place, from ``saved`` shards to
    ``world`` (``sizes``: unsharded); a shard missing or of the wrong size is a ValueError naming ``where``."""
    try:
        slots = method.parameter_state(state)
    except (KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{where}: the state of {method.name} is malformed ({err!r})") from err
    for slot, tensors in slots.items():
        for name, size in sizes.items():
            _move(tensors, name, size, saved, world, f"{where}: {slot!r} of parameter {name!r}")
    again = method.parameter_state(state)
    if any(set(again[slot]) != set(tensors) for slot, tensors in slots.items()):
        raise RuntimeError(f"{method.name}: parameter_state must return the state's own dicts, so that a resize "
                           "under FSDP2 can re-shard them")


def _move(tensors: dict, name: str, size: torch.Size, saved: int, world: int, where: str) -> None:
    """Parameter ``name``'s pieces of ``saved`` shards in ``tensors`` replaced, in place, by those of ``world``."""
    old = [f"{name}[{s}]" for s in range(saved)]
    held = [k for k in old if k in tensors]
    if not held:
        return
    inner = math.prod(size[1:])
    rows = size[0] if len(size) else 1
    chunk = -(-rows // saved) * inner
    if len(held) != saved:
        raise ValueError(f"{where}: {len(held)} of its {saved} shards ({', '.join(held)}); a resize needs all")
    for k in old:
        t = tensors[k]
        if not isinstance(t, torch.Tensor) or t.numel() != chunk:
            got = t.numel() if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{where}: shard {k!r} holds {got} entries, a shard of {tuple(size)} at world size "
                             f"{saved} has {chunk}")
    whole = torch.cat([tensors.pop(k).reshape(-1) for k in old])[:rows * inner]
    padded = whole.new_zeros(-(-rows // world) * world * inner)
    padded[:whole.numel()] = whole
    for s, piece in enumerate(padded.chunk(world)):
        tensors[f"{name}[{s}]"] = piece.clone()
