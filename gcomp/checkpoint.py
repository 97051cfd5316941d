"""A state's checkpoint: every rank's part is its own (error feedback holds what *that* rank held back), filed
under its rank (docs/checkpoints-and-faults.md says how to save and resume)::

    {"format": "gcomp.<kind>/4", "method": ..., "params": ..., "world_size": N, "iteration": ...,
     "ranks": {"rank<r>": <bytes: torch.save of {"stats", "method"[, "layouts"]}>}}

``kind`` is the state's (ddp, fsdp, hsdp, diloco); formats ``gcomp.hook/1`` to ``/3`` are read and upgraded. Each
part is one bytes value, so ``torch.distributed.checkpoint`` stores every rank's under its own key.
"""
from __future__ import annotations

import io
import math
import warnings
from typing import Any

import torch

from gcomp.method import Method, MethodUnit
from gcomp.sharding import reshard_parameters
from gcomp.state_checks import check_state

VERSION = 4
KINDS = ("ddp", "fsdp", "hsdp", "diloco")
SHARED_FORMAT = "gcomp.hook/3"  # every kind's, before the kind was named: read as the loading state's kind
PARTS_FORMAT = "gcomp.hook/2"  # each rank's part {"stats", "memory", "compressor"}: read, upgraded
LEGACY_FORMAT = "gcomp.hook/1"  # one rank's state, no rank recorded
AFRESH = ("install it and skip load_state_dict for this checkpoint (the model's and optimizer's states load as "
          "they are; gcomp's step count and statistics restart at 0)")
HOW_TO_SAVE = ("save every rank's state in one object with hook_state.gather_state_dict() (a collective; then "
               "save it on one rank), or torch.distributed.checkpoint (dcp.save({'gcomp': hook_state})), or each "
               "rank's hook_state.state_dict() in a file of its own")


def rank_key(rank: int) -> str:
    return f"rank{rank}"


def pack(part: dict) -> bytes:
    buffer = io.BytesIO()
    torch.save(part, buffer)
    return buffer.getvalue()


def _load(key: str, blob: bytes) -> Any:
    try:
        return torch.load(io.BytesIO(blob), weights_only=True)
    except Exception as err:  # noqa: BLE001 -- any unreadable part is the same user error
        raise ValueError(f"gcomp checkpoint: the state of {key} cannot be read ({type(err).__name__}: {err}); "
                         "the file is truncated or not a gcomp hook state") from err


def unpack(key: str, blob: bytes) -> dict:
    part = _load(key, blob)
    check_state(f"gcomp checkpoint ({key})", part, {"stats": dict, "method": dict}, {"layouts": list})
    return part


def state_format(kind: str) -> str:
    return f"gcomp.{kind}/{VERSION}"


def upgrade(state: Any, method: MethodUnit, rank: int, world_size: int, kind: str) -> Any:
    """A checkpoint of an earlier format in today's (``/2``'s parts held memory and compressor side by side; a
    composite's memory was empty); anything else as it is, for ``check_header`` to judge."""
    if not isinstance(state, dict):
        return state
    if state.get("format") == SHARED_FORMAT:
        return {**state, "format": state_format(kind)}
    if state.get("format") == LEGACY_FORMAT:
        state = from_legacy(state, rank, world_size)
    if state.get("format") != PARTS_FORMAT or not isinstance(state.get("ranks"), dict):
        return state
    ranks = {}
    for key, blob in state["ranks"].items():
        if not isinstance(blob, bytes):
            return state  # check_header names what is wrong
        part = _load(key, blob)
        check_state(f"gcomp checkpoint ({key})", part, {"stats": dict, "memory": dict, "compressor": dict})
        if isinstance(method, Method):
            own = {"memory": part["memory"], "compressor": part["compressor"]}
        elif part["memory"]:
            raise ValueError(f"gcomp checkpoint ({key}): a {method.name} state of format {PARTS_FORMAT} holds a "
                             f"memory state, which {method.name} never kept")
        else:
            own = part["compressor"]
        ranks[key] = pack({"stats": part["stats"], "method": own})
    return {**state, "format": state_format(kind), "ranks": ranks}


def check_header(state: Any, method: MethodUnit, kind: str) -> None:
    """The parts of a checkpoint every rank shares: format, method and parameters, world size, step."""
    if not isinstance(state, dict):
        raise ValueError(f"not a gcomp hook state: expected a dict, got {type(state).__name__} (an empty or "
                         "truncated checkpoint file?)")
    found, expected = state.get("format"), state_format(kind)
    if found != expected:
        other = next((k for k in KINDS if found == state_format(k)), None)
        if other is not None:
            raise ValueError(f"this gcomp checkpoint is a {other} state's ({found}); this state is a {kind} state's: "
                             f"load it into the kind of state that saved it")
        raise ValueError(f"not a gcomp state (format {found!r}, expected {expected!r})")
    check_state("gcomp checkpoint", state, {"format": str, "method": str, "params": dict, "world_size": int,
                                            "iteration": int, "ranks": dict})
    if state["method"] != method.name or state["params"] != method.params:
        raise ValueError(f"checkpoint is for {state['method']}({state['params']}), "
                         f"the installed method is {method.name}({method.params})")
    if state["world_size"] < 1:
        raise ValueError(f"gcomp checkpoint: 'world_size' must be at least 1, got {state['world_size']}")
    if state["iteration"] < 0:
        raise ValueError(f"gcomp checkpoint: 'iteration' must be at least 0, got {state['iteration']}")
    ranks = state["ranks"]
    if not ranks or not all(isinstance(k, str) and k.startswith("rank") and isinstance(v, bytes)
                            for k, v in ranks.items()):
        raise ValueError("gcomp checkpoint: 'ranks' must map 'rank<r>' to each rank's saved state (bytes)")


def from_legacy(state: dict, rank: int, world_size: int) -> dict:
    """A state of the first format (one rank's, no rank recorded), taken as this rank's own, with a warning."""
    check_state("gcomp checkpoint", state, {"format": str, "method": str, "params": dict, "iteration": int,
                                            "stats": dict, "memory": dict, "compressor": dict})
    warnings.warn("this gcomp checkpoint records no rank (format gcomp.hook/1): it is loaded as this rank's "
                  "own state; if one rank saved it for all, each rank now holds that rank's residuals",
                  RuntimeWarning, stacklevel=3)
    part = {k: state[k] for k in ("stats", "memory", "compressor")}
    return {"format": PARTS_FORMAT, "method": state["method"], "params": state["params"],
            "world_size": world_size, "iteration": state["iteration"], "ranks": {rank_key(rank): pack(part)}}


def own_part(state: dict, method: MethodUnit, rank: int, world_size: int,
             shard_sizes: dict[str, torch.Size] | None = None) -> dict:
    """This rank's ``{"stats", "method"}``: its own, any rank's for a replicated state, or merged from every old
    rank's after a change of world size (under FSDP2, ``shard_sizes`` given, re-sharded by parameter first)."""
    saved_world, ranks = state["world_size"], state["ranks"]
    mine = ranks.get(rank_key(rank))
    if saved_world == world_size and mine is not None:
        return unpack(rank_key(rank), mine)
    if method.replicated:
        key = sorted(ranks)[0]
        return unpack(key, ranks[key])
    held = sorted(ranks, key=lambda k: int(k[4:]) if k[4:].isdigit() else -1)
    if saved_world == world_size:
        raise ValueError(f"this gcomp checkpoint holds the state of {', '.join(held)} of a {saved_world}-rank "
                         f"run, not of rank {rank}: {method.name} keeps state per rank (its residuals are what "
                         f"this rank held back), and another rank's would change the run. {HOW_TO_SAVE}")
    if len(ranks) != saved_world or set(ranks) != {rank_key(r) for r in range(saved_world)}:
        raise ValueError(f"{resized(saved_world, world_size)}: the checkpoint holds {', '.join(held)}, and resuming "
                         f"on {world_size} ranks needs every rank's state in one object, saved with "
                         "hook_state.gather_state_dict() (a collective; then save it on one rank). "
                         "torch.distributed.checkpoint and a file per rank hold each rank's own part, which "
                         "resumes on the same number of ranks only")
    every = [unpack(rank_key(r), ranks[rank_key(r)]) for r in range(saved_world)]
    if shard_sizes is not None:  # per-parameter state onto this run's shards first
        for r, part in enumerate(every):
            reshard_parameters(method, part["method"], shard_sizes, saved_world, world_size,
                               f"gcomp checkpoint ({rank_key(r)})")
    assigned = [every[r] for r in range(saved_world) if r % world_size == rank]
    try:
        merged = method.merge_states([p["method"] for p in assigned], [p["method"] for p in every], rank)
    except ValueError as err:
        why = f"cannot move its state to another number of {'shards' if shard_sizes else 'ranks'} ({err})"
        raise ValueError(refuse_resize(method, saved_world, world_size, why)) from err
    return {"stats": assigned[0]["stats"] if assigned else {}, "method": merged}


def resized(saved_world: int, world_size: int) -> str:
    return f"gcomp checkpoint saved at world size {saved_world}, this run has {world_size}"


def refuse_resize(method: MethodUnit, saved_world: int, world_size: int, why: str) -> str:
    """The message of a resize ``method`` cannot honour (``why`` follows its name), and the two ways on."""
    return (f"{resized(saved_world, world_size)}: {method.name} {why}; resume on {saved_world} ranks, or start "
            f"{method.name}'s state afresh: {AFRESH}")


def check_parameter_tensors(method: MethodUnit, part: dict, numels: dict[str, int]) -> None:
    """The per-parameter tensors of a rank's part: parameters the model has, of their size, finite."""
    try:
        slots = method.parameter_state(part["method"])
    except KeyError as err:
        raise ValueError(f"gcomp checkpoint: the state of {method.name} has no {err.args[0]!r}") from err
    except (TypeError, AttributeError) as err:
        raise ValueError(f"gcomp checkpoint: the state of {method.name} is malformed ({err!r})") from err
    for slot, tensors in slots.items():
        for name, tensor in tensors.items():
            where = f"gcomp checkpoint: {slot!r} of parameter {name!r}"
            if name not in numels:
                raise ValueError(f"{where}: the model has no such parameter (it has {len(numels)}, e.g. "
                                 f"{', '.join(list(numels)[:3])})")
            if not isinstance(tensor, torch.Tensor) or tensor.numel() != numels[name]:
                size = tensor.numel() if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise ValueError(f"{where}: {size} entries, the parameter has {numels[name]}")
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise ValueError(f"{where}: holds non-finite values")


def check_stats(stats: dict) -> None:
    for key, value in stats.items():
        if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value < 0:
            raise ValueError(f"gcomp checkpoint: statistic {key!r} must be a non-negative number, got {value!r}")
