"""Rank jobs for tests/test_bad_input.py: the cases that need a DDP model and so a process group (one rank)."""
from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.nn.utils import prune as torch_prune

import gcomp
from gcomp import checkpoint
from tests.models import ddp, mlp, train


def _outcome(call) -> tuple:
    """("ok", warnings said) or (exception type name, its message)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            call()
        except Exception as err:  # noqa: BLE001 -- the table inspects it
            return type(err).__name__, str(err)
    said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    return ("warns" if said else "ok"), " | ".join(said)


def _pruned_mlp() -> nn.Module:
    model = mlp(0)
    torch_prune.l1_unstructured(model[0], "weight", 0.5)
    return model


def _trained_state(name: str, model: nn.Module | None = None, **params) -> dict:
    model = ddp(model if model is not None else mlp(0))
    state = gcomp.install(model, name, **params)
    train(model, 4)
    return state.state_dict()


def _edit_part(state: dict, edit) -> dict:
    """``state`` with this rank's part changed by ``edit(part)`` (the part is unpacked and packed back)."""
    key = checkpoint.rank_key(0)
    part = checkpoint.unpack(key, state["ranks"][key])
    edit(part)
    return {**state, "ranks": {key: checkpoint.pack(part)}}


def _load(state: dict, name: str = "topk", model: nn.Module | None = None, **params):
    params = params or ({"ratio": 0.05} if name == "topk" else {})

    def call():
        gcomp.install(ddp(model if model is not None else mlp(0)), name, **params).load_state_dict(state)
    return call


def _two_ranks(state: dict) -> dict:
    """A one-rank ``state`` as a gathered checkpoint of 2 ranks would be (rank 0's part twice)."""
    return {**state, "world_size": 2, "ranks": {"rank0": state["ranks"]["rank0"], "rank1": state["ranks"]["rank0"]}}


def _sharded(pruned: bool = False):
    from tests.fsdp.fsdp_jobs import build
    return build(pruned)


def _install_twice(first: str) -> None:
    """gcomp.install on a fully_shard-ed model's root and on one of its FSDP children, ``first`` first."""
    model = _sharded()
    order = [model, model[0]] if first == "root" else [model[0], model]
    for module in order:
        gcomp.install(module, "fp16")


def _fsdp_resized(name: str, **params) -> None:
    model = _sharded(pruned=True)
    state = gcomp.install(model, name, **params)
    from tests.fsdp.fsdp_jobs import train as train_sharded
    train_sharded(model, 2)
    saved = _two_ranks(state.state_dict())
    gcomp.install(_sharded(pruned=True), name, **params).load_state_dict(saved)


def install_and_load_cases() -> dict:
    out = {}
    model = ddp(mlp(0))
    gcomp.install(model, "identity")
    topk = _trained_state("topk", ratio=0.05)
    residual = next(iter(checkpoint.unpack("rank0", topk["ranks"]["rank0"])["method"]["memory"]["residuals"]))
    pactrain = _trained_state("pactrain", _pruned_mlp(), stable_steps=1)

    cases = {
        "install: a model that is not DDP": lambda: gcomp.install(mlp(0), "topk"),
        "install: a second hook": lambda: gcomp.install(model, "topk"),
        "install: parameters with a Method": lambda: gcomp.install(ddp(mlp(0)), gcomp.create("topk"), ratio=0.1),
        "install: neither name nor Method": lambda: gcomp.install(ddp(mlp(0)), 3),
        "install: an unknown name": lambda: gcomp.install(ddp(mlp(0)), "topkk"),
        "install: seed=2**70": lambda: gcomp.install(ddp(mlp(0)), "terngrad", seed=2**70),
        "install: pactrain on a model with no masks": lambda: gcomp.install(ddp(mlp(0)), "pactrain"),
        "install: powersgd whose rank leaves every matrix dense": lambda: gcomp.install(ddp(mlp(0)), "powersgd",
                                                                                        rank=64),
        "install: hierarchical on one node": lambda: gcomp.install(ddp(mlp(0)), "hierarchical"),
        "load: not a dict (an empty file)": _load(None),
        "load: not a gcomp state": _load({"format": "something else"}),
        "load: a missing key": _load({k: v for k, v in topk.items() if k != "iteration"}),
        "load: a negative iteration": _load({**topk, "iteration": -1}),
        "load: an iteration of the wrong type": _load({**topk, "iteration": "4"}),
        "load: a world size of 0": _load({**topk, "world_size": 0}),
        "load: a truncated rank state": _load({**topk, "ranks": {"rank0": topk["ranks"]["rank0"][:50]}}),
        "load: another rank's state": _load({**topk, "ranks": {"rank1": topk["ranks"]["rank0"]}}),
        "load: another method's state": _load(topk, "randomk"),
        "load: other parameters": _load(topk, "topk", ratio=0.5),
        "load: a residual of the wrong size": _load(_edit_part(topk, lambda p: p["method"]["memory"]["residuals"].update(
            {residual: torch.zeros(3)})), ratio=0.05),
        "load: a non-finite residual": _load(_edit_part(topk, lambda p: p["method"]["memory"]["residuals"][residual].fill_(
            float("nan"))), ratio=0.05),
        "load: a residual for a parameter the model lacks": _load(_edit_part(
            topk, lambda p: p["method"]["memory"]["residuals"].update({"head.weight": torch.zeros(3)})), ratio=0.05),
        "load: residuals missing": _load(_edit_part(topk, lambda p: p["method"]["memory"].pop("residuals")), ratio=0.05),
        "load: a negative statistic": _load(_edit_part(topk, lambda p: p["stats"].update(steps=-2)), ratio=0.05),
        "load: an unknown tracker mode": _load(_edit_part(pactrain, lambda p: [
            e.update(mode="frozen") for e in p["method"]["compressor"]["tracker"].values()]), "pactrain", _pruned_mlp(),
            stable_steps=1),
        "install: a second install on an FSDP child after the root": lambda: _install_twice("root"),
        "install: an install on the root after one on an FSDP child": lambda: _install_twice("child"),
        "load: FSDP2 pactrain saved on 2 ranks, resumed on 1": lambda: _fsdp_resized(
            "pactrain", ternary=True, error_feedback=True),
        "install: dense= on an FSDP2 model": lambda: gcomp.install(_sharded(), "topk", dense="*.bias"),
        "load: signum saved on 2 ranks, resumed on 1": _load(_two_ranks(_trained_state("signum")), "signum"),
    }
    for label, call in cases.items():
        out[label] = _outcome(call)
    return out
