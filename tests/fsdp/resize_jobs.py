"""Rank jobs for tests/fsdp/test_resize.py: an FSDP2 checkpoint gathered on one number of ranks, resumed on another."""
from __future__ import annotations

import torch
import torch.distributed as dist

import gcomp
from gcomp import checkpoint
from tests.fsdp.fsdp_jobs import build, full_params, train

RESHARDED = [("randomk", "randomk", {"ratio": 0.3}, False), ("spardl", "spardl", {"density": 0.3}, False)]
REFUSED = [("pactrain-ternary-ef", "pactrain", {"ternary": True, "error_feedback": True}, True),
           ("pactrain", "pactrain", {}, True)]


def save(runs) -> dict:
    """Per run: 3 steps, then every rank's state gathered (rank 0's copy returned), and the parameters' sizes."""
    out = {}
    for label, name, params, pruned in runs:
        model = build(pruned)
        state = gcomp.install(model, name, **params)
        train(model, 3)
        out[label] = state.gather_state_dict()
    out["sizes"] = {n: tuple(p.size()) for n, p in build(False).named_parameters()}
    return out


def zeroed(state: dict, method: gcomp.MethodUnit) -> dict:
    """``state`` with every rank's per-parameter tensors (residuals) zero: the control of a resume that loads
    everything but them."""
    ranks = {}
    for key, blob in state["ranks"].items():
        part = checkpoint.unpack(key, blob)
        for tensors in method.parameter_state(part["method"]).values():
            for t in tensors.values():
                t.zero_()
        ranks[key] = checkpoint.pack(part)
    return {**state, "ranks": ranks}


def resume(runs, saved: dict) -> dict:
    """Per run, on this world size: the error of the load, or this rank's per-parameter state right after it
    (before any step) and whether one step after it differs from a step after a load of the same checkpoint with
    the residuals zeroed (it would not if the residuals were never taken up)."""
    out = {}
    for label, name, params, pruned in runs:
        model = build(pruned)
        state = gcomp.install(model, name, **params)
        try:
            state.load_state_dict(saved[label])
        except ValueError as err:
            out[label] = {"error": str(err)}
            continue
        part = checkpoint.unpack("mine", state.state_dict()["ranks"][checkpoint.rank_key(dist.get_rank())])
        loaded = state.method.parameter_state(part["method"])
        train(model, 1, start=3)
        control = build(pruned)
        control_state = gcomp.install(control, name, **params)
        control_state.load_state_dict(zeroed(saved[label], control_state.method))
        train(control, 1, start=3)
        a, b = full_params(model), full_params(control)
        out[label] = {"loaded": loaded, "differs": any(not torch.equal(a[k], b[k]) for k in a),
                      "iteration": state.iteration}
    return out
