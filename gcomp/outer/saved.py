"""The outer part of a ``DiLoCo`` checkpoint, beside ``gcomp.run_state``'s (the method's state, per rank)::

    "outer": {"settings": {"sync_every", "fragments", "overlap", "bucket_mb", "alpha"}, "layout": [bucket keys],
              "theta": {parameter name: tensor}, "optimizer": <the outer optimizer's state_dict>,
              "pending": {} or {"fragment", "apply_at", "means": [flat tensors]}, "syncs": fragment syncs applied}

The same on every rank (the global copy, the outer optimizer and a reduction's result are replicated), so a
resumed run on another world size takes it as it is; tensors and plain values only (``weights_only=True``).
"""
from __future__ import annotations

import torch

from gcomp.outer.fragments import Pending
from gcomp.state_checks import check_state

OWNER = "gcomp.outer checkpoint"


def settings(outer) -> dict:
    return {"sync_every": outer.sync_every, "fragments": outer.fragments, "overlap": outer.overlap,
            "bucket_mb": float(outer.bucket_mb), "alpha": float(outer.alpha)}


def outer_state(outer) -> dict:
    """The outer part of ``outer``'s checkpoint; a reduction in flight is waited for (its result is saved)."""
    theta = {}
    for fragment in outer.layout:
        for b in fragment:
            flat = outer.theta[b.info.index].detach()
            for name, piece in zip(b.info.names, flat.split(b.info.numels)):
                theta[name] = piece.clone()
    pending = {}
    if outer._pending is not None:
        p = outer._pending
        pending = {"fragment": p.fragment, "apply_at": p.apply_at, "means": [m.clone() for m in p.result()]}
    return {"settings": settings(outer), "layout": [b.info.key for f in outer.layout for b in f], "theta": theta,
            "optimizer": outer.outer_optimizer.state_dict(), "pending": pending,
            "syncs": outer._syncs}


def check_outer(outer, state) -> None:
    """``state`` (the checkpoint's ``"outer"``) fits ``outer``: a ValueError naming what does not."""
    if state is None:
        raise ValueError(f"{OWNER}: the checkpoint has no 'outer' part: it is not a gcomp.outer.DiLoCo state (a DDP "
                         "hook's state?)")
    check_state(OWNER, state, {"settings": dict, "layout": list, "theta": dict, "optimizer": dict, "pending": dict,
                                    "syncs": int})
    if state["settings"] != settings(outer):
        raise ValueError(f"{OWNER}: saved with {state['settings']}, this DiLoCo has {settings(outer)}")
    keys = [b.info.key for f in outer.layout for b in f]
    if state["layout"] != keys:
        raise ValueError(f"{OWNER}: the outer buckets differ (saved {len(state['layout'])}, here {len(keys)}; same "
                         "model, fragments and bucket_mb needed)")
    for name, numel in outer._numels.items():
        t = state["theta"].get(name)
        if not isinstance(t, torch.Tensor) or t.numel() != numel or not t.is_floating_point():
            raise ValueError(f"{OWNER}: the global copy of {name!r} is missing or not {numel} floats")
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{OWNER}: the global copy of {name!r} holds non-finite values")
    if set(state["theta"]) != set(outer._numels):
        extra = sorted(set(state["theta"]) - set(outer._numels))
        raise ValueError(f"{OWNER}: the global copy holds parameters the model lacks: {', '.join(extra[:4])}")
    pending = state["pending"]
    if pending:
        check_state(f"{OWNER} ('pending')", pending, {"fragment": int, "apply_at": int, "means": list})
        f = pending["fragment"]
        if not 0 <= f < outer.fragments:
            raise ValueError(f"{OWNER}: the reduction in flight is of fragment {f}, of {outer.fragments}")
        sizes = [b.info.numel for b in outer.layout[f]]
        if [m.numel() if isinstance(m, torch.Tensor) else -1 for m in pending["means"]] != sizes:
            raise ValueError(f"{OWNER}: the reduction in flight does not fit fragment {f}'s buckets {sizes}")


def load_outer(outer, state: dict) -> None:
    """Take up a checked outer part: the global copy, the outer optimizer, the reduction in flight."""
    with torch.no_grad():
        for fragment in outer.layout:
            for b in fragment:
                flat = torch.cat([state["theta"][n].reshape(-1) for n in b.info.names])
                outer.theta[b.info.index].copy_(flat.to(outer.theta[b.info.index].dtype))
    try:
        outer.outer_optimizer.load_state_dict(state["optimizer"])
    except (ValueError, KeyError, TypeError, RuntimeError) as err:
        raise ValueError(f"{OWNER}: the outer optimizer's state does not load ({err})") from err
    pending = state["pending"]
    outer._pending = Pending(pending["fragment"], pending["apply_at"],
                             means=[m.clone() for m in pending["means"]]) if pending else None
    outer._syncs = state["syncs"]
