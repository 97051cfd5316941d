"""The rank jobs of contracts 2, 4 and 7: DDP training with the method's hook, plain DDP next to it, and
checkpoints resumed on a fresh model and hook; several configurations per call (``process_checks`` reads them)."""
from __future__ import annotations

import io

import torch

from gcomp.testing import models
from gcomp.testing.source import MethodSource, as_source

TRAIN_STEPS = 4           # DDP steps: past the static_graph warm-up (2 steps) with 2 compressing steps to spare
RESUME_AT, RESUME_STEPS = 2, 3   # one checkpoint after 2 steps, then 3 more
TRAIN_CONFIGS = [(several, static) for several in (False, True) for static in (False, True)]


def _train_one(source: MethodSource | None, several: bool, static: bool, steps: int, seed: int) -> dict:
    model = models.mlp(seed)
    init = models.flat_params(model).clone()
    kwargs = {"static_graph": static}
    if several:
        kwargs["bucket_cap_mb"] = models.SEVERAL_BUCKETS_MB
    ddp_model = models.ddp(model, **kwargs)
    state = source.install(ddp_model) if source is not None else None
    losses = torch.stack(models.train(ddp_model, steps))
    return {"params": models.flat_params(ddp_model.module).clone(), "init": init, "losses": losses,
            "stats": dict(state.stats) if state is not None else None}


def job_train(method: str | MethodSource, configs: list[tuple[bool, bool]] = tuple(TRAIN_CONFIGS),
              reference: bool = False, steps: int = TRAIN_STEPS, seed: int = 0) -> dict:
    """Contracts 2 and 4: each ``(several_buckets, static_graph)`` configuration trained; with ``reference`` a plain
    DDP run (no hook) of it too."""
    source = as_source(method)
    out = {}
    for several, static in configs:
        out[(several, static)] = _train_one(source, several, static, steps, seed)
        if reference:
            out[(several, static)]["reference"] = _train_one(None, several, static, steps, seed)["params"]
    return out


# name -> (DDP options, steps between checkpoints). "rebuilt": plain DDP, the fresh model on its initial buckets
# (reduced as the saved layouts, gcomp.resume_layouts). "fixed": find_unused_parameters, one layout throughout.
# "chained": a checkpoint after every step, one with no step in between; its first before DDP's rebuild.
RESUMES = {
    "rebuilt": ({}, [RESUME_AT, RESUME_STEPS]),
    "fixed": ({"find_unused_parameters": True}, [RESUME_AT, RESUME_STEPS]),
    "fixed-several": ({"find_unused_parameters": True, "bucket_cap_mb": models.SEVERAL_BUCKETS_MB},
                      [RESUME_AT, RESUME_STEPS]),
    "chained": ({}, [1, 1, 0, 1, 1]),
    "chained-static": ({"static_graph": True}, [1, 1, 0, 1, 1]),
}
# the resumes whose buckets are laid out as the saved run's (the chained ones resume on DDP's first bucket)
LAYOUT_KEPT = ("rebuilt", "fixed", "fixed-several")
RESUME_WORLD = 2


def _resumed_run(source: MethodSource, kwargs: dict, schedule: list[int], seed: int) -> tuple[torch.Tensor, int]:
    """Train ``schedule[0]`` steps, then per later entry: checkpoint (torch.save, torch.load(weights_only=True)),
    a fresh model, DDP and hook from it, that many more steps."""
    model = models.ddp(models.mlp(seed), **kwargs)
    state = source.install(model)
    models.train(model, schedule[0])
    done = schedule[0]
    for steps in schedule[1:]:
        buf = io.BytesIO()
        torch.save({"model": model.module.state_dict(), "hook": state.state_dict()}, buf)
        buf.seek(0)
        checkpoint = torch.load(buf, weights_only=True)
        fresh = models.mlp(seed + 1)  # other initial values: everything must come from the checkpoint
        fresh.load_state_dict(checkpoint["model"])
        model = models.ddp(fresh, **kwargs)
        state = source.install(model)
        state.load_state_dict(checkpoint["hook"])
        models.train(model, steps, start=done)
        done += steps
    return models.flat_params(model.module).clone(), state.stats["steps"]


def job_resume(methods: list, seed: int = 0) -> dict:
    """Contract 7: every ``RESUMES`` case against as many steps without stopping; ``methods``: names or
    ``MethodSource``s; results keyed by ``(method as given, flavour)``."""
    out = {}
    for method in methods:
        source = as_source(method)
        for flavour, (kwargs, schedule) in RESUMES.items():
            straight, straight_steps = _resumed_run(source, kwargs, [sum(schedule)], seed)
            resumed, resumed_steps = _resumed_run(source, kwargs, schedule, seed)
            out[(method, flavour)] = {"straight": straight, "resumed": resumed, "steps": sum(schedule),
                                      "straight_steps": straight_steps, "resumed_steps": resumed_steps}
    return out
