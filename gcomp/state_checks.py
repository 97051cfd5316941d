"""Checks of a checkpoint's contents: a bad state fails at ``load_state_dict`` with a ValueError naming the key,
never at the first backward."""
from __future__ import annotations

from typing import Any, Sequence

import torch


def check_state_keys(owner: object, state: dict, allowed: Sequence[str]) -> None:
    """Raise a clear error when a checkpoint holds keys ``owner`` does not know."""
    unknown = set(state) - set(allowed)
    if unknown:
        raise ValueError(f"{owner if isinstance(owner, str) else type(owner).__name__}: unexpected keys "
                         f"{sorted(unknown)}")


def check_state(owner: object, state: Any, required: dict[str, Any], optional: dict[str, Any] | None = None
                ) -> None:
    """``state`` is a dict with every key of ``required``, none outside ``required`` and ``optional``, each value of
    the type (or tuple of types) its key maps to; else a ValueError naming the key."""
    name = owner if isinstance(owner, str) else type(owner).__name__
    if not isinstance(state, dict):
        raise ValueError(f"{name}: the state must be a dict, got {type(state).__name__}")
    known = {**required, **(optional or {})}
    check_state_keys(name, state, known)
    missing = [k for k in required if k not in state]
    if missing:
        raise ValueError(f"{name}: the state has no {', '.join(repr(k) for k in missing)}")
    for key, value in state.items():
        if not isinstance(value, known[key]) or isinstance(value, bool) and known[key] in (int, (int, float)):
            expected = known[key].__name__ if isinstance(known[key], type) else " or ".join(
                t.__name__ for t in known[key])
            article = "an" if expected[0] in "aeiou" else "a"
            raise ValueError(f"{name}: {key!r} must be {article} {expected}, got {type(value).__name__}")


def tensor_dict(owner: str, key: str, value: Any) -> dict[str, torch.Tensor]:
    """``value``, checked to be a ``{name: tensor}`` dict (per-parameter state)."""
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(t, torch.Tensor)
                                              for k, t in value.items()):
        raise ValueError(f"{owner}: {key!r} must map parameter names to tensors")
    return value


def sum_by_name(states: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Per-parameter tensors of several ranks added up, name by name (error feedback kept across a resize)."""
    total: dict[str, torch.Tensor] = {}
    for state in states:
        for name, t in state.items():
            total[name] = t.clone() if name not in total else total[name] + t
    return total


def generator_state(owner: str, device: str, state: Any) -> torch.Tensor:
    """``state`` checked to be what ``torch.Generator(device).set_state`` takes (for a device this process lacks,
    its type only); else a ValueError naming ``owner``, the device and both sizes."""
    where = f"{owner}: the random generator state for device {device!r}"
    try:
        place = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"{where}: {device!r} is not a device (the states are keyed 'cpu', 'cuda:0', ...)") from None
    try:
        probe = torch.Generator(place)
    except RuntimeError:  # a device this process lacks
        probe = None
    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.dim() != 1:
        kind = f"a {state.dtype} tensor of shape {tuple(state.shape)}" if isinstance(state, torch.Tensor) \
            else type(state).__name__
        raise ValueError(f"{where} must be a 1-D torch.uint8 tensor (Generator.get_state()), got {kind}")
    if probe is None:
        return state
    expected = probe.get_state().numel()
    try:
        probe.set_state(state)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"{where} holds {state.numel()} bytes, a {place.type} generator's holds "
                         f"{expected} (a checkpoint of another torch version, or not this method's state?): "
                         f"{err}") from None
    return state
