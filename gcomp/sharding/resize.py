"""A method's per-parameter state under FSDP2 moved onto another number of shards, by parameter.

Under FSDP2 a method's per-parameter state (residuals) covers the rank's whole unsharded reduce-scatter input,
keyed by piece, ``"<parameter>[<shard>]"`` (``ShardLayout.pieces``): shard s of a parameter is its rows
s R to (s + 1) R once dim 0 is padded to a multiple of the shard count (R rows each). Another shard count cuts
it elsewhere, so when a checkpoint resumes on another world size, ``gcomp.checkpoint.own_part`` first rewrites
every old rank's per-parameter state onto this run's pieces with ``reshard_parameters`` (a parameter's pieces
joined, FSDP's padding dropped, cut again: the padding's gradient is zero, so nothing is held back there); the
merge then hands old rank j to new rank j mod N, residuals summed, so their sum over the ranks, which error
feedback owes the model, is kept. Only for methods whose row strategy keeps nothing else laid out by the shards
(``RowStrategy.reshards``); the others are refused there.
"""
from __future__ import annotations

import math

import torch


def reshard_parameters(method, state: dict, sizes: dict[str, torch.Size], saved: int, world: int,
                       where: str) -> None:
    """``state`` (one old rank's method state) with its per-parameter tensors (``method.parameter_state``) moved,
    in place, from ``saved`` shards to ``world`` (``sizes``: each parameter's unsharded size). A shard missing or
    of the wrong size: a ValueError naming ``where``, the slot, the parameter and both sizes."""
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
