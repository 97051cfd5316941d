"""An ``FSDPState`` checkpoint resumed on another number of shards: per-parameter state re-sharded by parameter,
or the resize refused on every rank alike.

Under FSDP2 a method's per-parameter state (residuals) covers the rank's whole unsharded reduce-scatter input,
keyed by piece, ``"<parameter>[<shard>]"`` (``ShardLayout.pieces``): shard s of a parameter is its rows
s R to (s + 1) R once dim 0 is padded to a multiple of the shard count (R rows each). Another shard count cuts
it elsewhere, so ``reshard`` first rewrites every old rank's per-parameter state onto this run's pieces (a
parameter's pieces joined, FSDP's padding dropped, cut again: the padding's gradient is zero, so nothing is held
back there); the checkpoint's merge then hands old rank j to new rank j mod N, residuals summed, so their sum over
the ranks, which error feedback owes the model, is kept.

A method whose row strategy keeps anything else laid out by the shards (``RowStrategy.reshards`` false:
``pactrain``'s mask tracker and ternary residuals, per layout and in the order of its kept entries) cannot
honour a resize. The decision reads only what every rank holds alike (the world size saved, this one, the
method), so every rank refuses, with the same message.
"""
from __future__ import annotations

import math

import torch

from gcomp import checkpoint
from gcomp.method import MethodUnit


def reshard(state, method: MethodUnit, sizes: dict[str, torch.Size], world: int):
    """``state`` with every old rank's per-parameter state on this run's ``world`` shards (``sizes``: each
    parameter's unsharded size); ``state`` itself when the world size is the same, the method's state the same on
    every rank, or the checkpoint such that ``RunState.load_state_dict`` will name what is wrong with it. A
    method that cannot honour the resize: a ValueError saying so and what to do."""
    try:
        if not isinstance(state, dict) or state.get("format") == checkpoint.LEGACY_FORMAT:
            return state
        current = checkpoint.upgrade(state, method, 0, world)
        checkpoint.check_header(current, method)
    except ValueError:
        return state
    saved, ranks = current["world_size"], current["ranks"]
    if saved == world or method.replicated or set(ranks) != {checkpoint.rank_key(r) for r in range(saved)}:
        return state
    strategy = method.row_strategy
    if strategy is None or not strategy.reshards:
        kept = strategy.shard_state if strategy is not None else "state laid out by FSDP2's shards"
        raise ValueError(checkpoint.refuse_resize(method, saved, world, f"under FSDP2 keeps {kept}, which no other "
                                                                        "number of shards can take up"))
    moved = {}
    for key, blob in ranks.items():
        try:
            part = checkpoint.unpack(key, blob)
            slots = method.parameter_state(part["method"])
        except (ValueError, KeyError, TypeError, AttributeError):
            return state  # the load names it
        for slot, tensors in slots.items():
            for name, size in sizes.items():
                _move(tensors, name, size, saved, world, f"gcomp checkpoint ({key}): {slot!r} of parameter {name!r}")
        again = method.parameter_state(part["method"])
        if any(set(again[slot]) != set(tensors) for slot, tensors in slots.items()):
            raise RuntimeError(f"{method.name}: parameter_state must return the state's own dicts, so that a resize "
                               "under FSDP2 can re-shard them")
        moved[key] = checkpoint.pack(part)
    return {**current, "ranks": moved}


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
