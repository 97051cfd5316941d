"""Rank jobs for tests/test_bad_input.py (its load checks): checkpoints whose per-rank part does not fit the live model (a tensor,
a generator state or a ternary residual of the wrong size), loaded on one gloo rank; and a hook state bound to one
model and registered on another."""
from __future__ import annotations

import warnings

import torch
from torch import nn

import gcomp
from tests.bad_input_jobs import _edit_part
from tests.models import ddp, mlp, train
from tests.resume_jobs import pruned_mlp

TERNARY = {"ternary": True, "error_feedback": True}


def _outcome(call) -> tuple[str, str]:
    """("ok", "") or (the exception's type name, its message)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            call()
        except Exception as err:  # noqa: BLE001 -- the table inspects it
            return type(err).__name__, str(err)
    return "ok", ""


def _trained(name: str, model: nn.Module | None = None, **params) -> dict:
    model = ddp(model if model is not None else mlp(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = gcomp.install(model, name, **params)
        train(model, 4)
    return state.state_dict()


_edit = _edit_part  # rank 0's part changed by edit(part)


def _load_and_step(state: dict, name: str, model: nn.Module | None = None, **params):
    """Load ``state`` into a fresh DDP model and hook, then take a step: the load must refuse a bad state, not
    the step."""
    def call():
        target = ddp(model if model is not None else mlp(0))
        gcomp.install(target, name, **params).load_state_dict(state)
        train(target, 1, start=4)
    return call


def _first_track(part: dict) -> dict:
    """The pactrain tracker entry of the packed bucket (the one that carries a residual)."""
    return next(e for e in part["method"]["compressor"]["tracker"].values() if "residual" in e)


def _other_model() -> None:
    """A comm_hook state bound to one DDP model and registered on another (the issue's case)."""
    bound, other = ddp(mlp(0)), ddp(nn.Sequential(nn.Linear(20, 10)))
    state, hook = gcomp.comm_hook("topk", model=bound, ratio=0.05)
    other.register_comm_hook(state, hook)
    train(other, 3)


def load_cases() -> dict:
    ternary = _trained("pactrain", pruned_mlp(0), **TERNARY)
    terngrad = _trained("terngrad")
    dgc, randomk = _trained("dgc", ratio=0.05), _trained("randomk", ratio=0.05)
    powersgd, spardl = _trained("powersgd"), _trained("spardl", density=0.05)
    short = torch.zeros(100, dtype=torch.uint8)

    def set_generator(key: str, value):
        return lambda p: p["method"]["compressor"].update(generator=value if key is None else {key: value})

    cases = {
        "pactrain: a generator state of the wrong size": _load_and_step(
            _edit(ternary, set_generator("cpu", short)), "pactrain", pruned_mlp(0), **TERNARY),
        "terngrad: a generator state that is not uint8": _load_and_step(
            _edit(terngrad, set_generator("cpu", torch.zeros(5056))), "terngrad"),
        "dgc: a generator state of the wrong size": _load_and_step(
            _edit(dgc, set_generator(None, short)), "dgc", ratio=0.05),
        "randomk: a generator state of the wrong size": _load_and_step(
            _edit(randomk, set_generator(None, short)), "randomk", ratio=0.05),
        "powersgd: a generator state of the wrong size": _load_and_step(
            _edit(powersgd, set_generator(None, short)), "powersgd"),
        "powersgd: a query of the wrong shape": _load_and_step(_edit(powersgd, lambda p: p["method"]["compressor"][
            "queries"].update({"2.weight": torch.zeros(16, 2)})), "powersgd"),
        "powersgd: an error of the wrong size": _load_and_step(_edit(powersgd, lambda p: p["method"]["compressor"][
            "errors"].update({"2.weight": torch.zeros(1000)})), "powersgd"),
        "pactrain: a ternary residual of the wrong size": _load_and_step(
            _edit(ternary, lambda p: _first_track(p).update(residual=torch.zeros(7))), "pactrain", pruned_mlp(0),
            **TERNARY),
        "pactrain: a ternary residual of the wrong dtype": _load_and_step(
            _edit(ternary, lambda p: _first_track(p).update(residual=_first_track(p)["residual"].double())),
            "pactrain", pruned_mlp(0), **TERNARY),
        "pactrain: carried exponents of the wrong size": _load_and_step(
            _edit(ternary, lambda p: _first_track(p).update(exponents=torch.zeros(9, dtype=torch.int64))),
            "pactrain", pruned_mlp(0), **TERNARY),
        "pactrain: carried exponents of the wrong size, no names saved": _load_and_step(
            _edit(ternary, lambda p: [_first_track(p).update(exponents=torch.zeros(9, dtype=torch.int64)),
                                      _first_track(p).pop("names")]), "pactrain", pruned_mlp(0), **TERNARY),
        "spardl: a union of two entries": _load_and_step(_edit(spardl, lambda p: p["method"]["compressor"][
            "budgets"].update({"b0:float32:1386:0": {"h": 1, "step": 0, "inertia": False,
                                                     "union": torch.tensor([3, 4])}})), "spardl", density=0.05),
        "layouts: not a list of layouts": _load_and_step(_edit(dgc, lambda p: p.update(layouts=[{"index": 0}])),
                                                          "dgc", ratio=0.05),
        "comm_hook: a state bound to another model": _other_model,
    }
    return {label: _outcome(call) for label, call in cases.items()}
