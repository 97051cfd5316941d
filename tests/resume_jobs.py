"""Rank jobs for tests/test_resume.py: a run that never stops against the same run checkpointed and resumed on a
fresh model, DDP and hook state, for every method that keeps state, on DDP's own bucket layouts (1, 2 or 3
buckets after its rebuild; one bucket of everything before it)."""
from __future__ import annotations

import io
import warnings

import torch
import torch.distributed as dist
from torch.nn.utils import prune

import gcomp
from tests import models

AFTER = 2  # steps resumed after the checkpoint
BUCKETS = {1: {}, 2: {"bucket_cap_mb": 0.002}, 3: {"bucket_cap_mb": 0.001}}  # buckets after DDP's rebuild
# name: (DDP options, the checkpoint after this many steps). DDP's first step (its first two with static_graph) is
# on one bucket of every parameter and the hook's warm-up; the checkpoint comes after the first compressed step
CONFIGS = {**{f"{n} bucket{'s' if n > 1 else ''}": (kwargs, 2) for n, kwargs in BUCKETS.items()},
           "3 buckets, static_graph": ({**BUCKETS[3], "static_graph": True}, 3),
           "3 buckets, find_unused_parameters": ({**BUCKETS[3], "find_unused_parameters": True}, 2)}
# the methods' parameters where their defaults would send (almost) nothing on this small model, or run nothing
# of their own on one node
PARAMS = {"dgc": {"ratio": 0.05}, "gtopk": {"density": 0.05}, "spardl": {"density": 0.05}, "randomk": {"ratio": 0.05},
          "topk": {"ratio": 0.05}, "hierarchical": {"inner": "topk:ratio=0.05", "ranks_per_node": 1},
          "prunex": {"ranks_per_node": 1, "ternary": True, "stable_steps": 1, "dense_above": 0.9}}
VARIANTS = {"pactrain:ternary": ("pactrain", {"ternary": True}),
            "pactrain:ternary,error_feedback": ("pactrain", {"ternary": True, "error_feedback": True})}


def cases() -> dict[str, tuple[str, dict]]:
    """Every registered method whose checkpoint holds state (``keeps_state``), but ``auto`` (a resumed run
    measures its candidates again), with ``PARAMS``; and pactrain's ternary variants."""
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in gcomp.available():
            if name != "auto" and gcomp.create(name, **PARAMS.get(name, {})).keeps_state:
                out[name] = (name, PARAMS.get(name, {}))
    return {**out, **VARIANTS}


def pruned_mlp(seed: int) -> torch.nn.Module:
    """``models.mlp`` with its first two weights pruned by magnitude (pactrain and prunex pack them)."""
    model = models.mlp(seed)
    for i in (0, 2):
        prune.l1_unstructured(model[i], "weight", amount=0.5)
    return model


def _round_trip(value):
    buf = io.BytesIO()
    torch.save(value, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _run(name: str, params: dict, ddp_kwargs: dict, schedule: list[int]):
    """Train ``schedule[0]`` steps; then for each later entry checkpoint (model and hook, through torch.save and
    torch.load with weights_only), build a fresh model, DDP and hook from it, and train that many more steps.
    Returns the parameters and the hook's statistics."""
    model = models.ddp(pruned_mlp(0), **ddp_kwargs)
    state = gcomp.install(model, name, **params)
    models.train(model, schedule[0])
    done = schedule[0]
    for steps in schedule[1:]:
        saved = _round_trip({"model": model.module.state_dict(), "hook": state.state_dict()})
        fresh = pruned_mlp(1)  # other weights and masks: everything must come from the checkpoint
        fresh.load_state_dict(saved["model"])
        model = models.ddp(fresh, **ddp_kwargs)
        state = gcomp.install(model, name, **params)
        state.load_state_dict(saved["hook"])
        models.train(model, steps, start=done)
        done += steps
    return models.flat_params(model.module), dict(state.stats)


def job_resume(names: list[str], configs: dict[str, tuple[dict, int]]) -> dict:
    """``{(case, config, schedule): (parameters equal, (bytes_sent straight, resumed), (steps straight,
    resumed))}``: each case of ``cases()`` in ``names`` on each of ``configs`` (``CONFIGS``' form) straight
    through, and checkpointed after its step ("resumed"), or checkpointed there, loaded and at once checkpointed
    again ("resaved"), ``AFTER`` steps more."""
    out = {}
    every = cases()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one node, pruned buckets sent dense: said at install, not the point here
        for case in names:
            name, params = every[case]
            for config, (kwargs, at) in configs.items():
                straight, stats = _run(name, params, kwargs, [at + AFTER])
                for label, schedule in (("resumed", [at, AFTER]), ("resaved", [at, 0, AFTER])):
                    resumed, again = _run(name, params, kwargs, schedule)
                    out[(case, config, label)] = (torch.equal(straight, resumed),
                                                  (stats["bytes_sent"], again["bytes_sent"]),
                                                  (stats["steps"], again["steps"]))
    return out


def job_layouts(buckets: int) -> list[list[str]]:
    """The layouts a hook state saves after 2 steps on ``buckets`` buckets: the names of each."""
    model = models.ddp(pruned_mlp(0), **BUCKETS[buckets])
    state = gcomp.install(model, "topk", ratio=0.05)
    models.train(model, 2)
    part = torch.load(io.BytesIO(state.state_dict()["ranks"][f"rank{dist.get_rank()}"]), weights_only=True)
    return [entry["names"] for entry in part["layouts"]]


def _same(a, b) -> bool:
    """``a`` and ``b`` hold the same keys, values and tensors (dtype, shape and every bit)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


def job_resave(names: list[str]) -> dict:
    """``{case: True when a state loaded and at once saved again holds exactly what was loaded}`` (this rank's
    part: statistics, the method's state, the layouts), after 2 steps on 3 buckets."""
    out, every = {}, cases()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for case in names:
            name, params = every[case]
            model = models.ddp(pruned_mlp(0), **BUCKETS[3])
            state = gcomp.install(model, name, **params)
            models.train(model, 2)
            saved = _round_trip(state.state_dict())
            fresh = gcomp.install(models.ddp(pruned_mlp(0), **BUCKETS[3]), name, **params)
            fresh.load_state_dict(saved)
            again = fresh.state_dict()
            key = f"rank{dist.get_rank()}"
            out[case] = _same(torch.load(io.BytesIO(saved["ranks"][key]), weights_only=True),
                              torch.load(io.BytesIO(again["ranks"][key]), weights_only=True))
    return out
