"""Rank job for tests/test_compile.py: the same DDP training eager and under ``torch.compile``, with gcomp's hook
installed before or after compiling.

One call runs every variant on the same ranks (the pattern of gcomp/testing/reduce_jobs.py), so the test pays for one
process group and one warm compile cache, not one per variant.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import gcomp
from tests import models

STEPS = 4
LR, MOMENTUM = 0.1, 0.9
VARIANTS = ("eager", "install_then_compile", "compile_then_install")
BACKENDS = ("inductor", "aot_eager")  # the first that compiles on every rank is used


def _probe(backend: str) -> str | None:
    """None when a tiny function compiles and runs right with ``backend`` here, else why not."""
    torch._dynamo.reset()
    try:
        fn = torch.compile(lambda x: torch.relu(x) * 2 + 1, backend=backend, fullgraph=True)
        x = torch.linspace(-1, 1, 8)
        if not torch.equal(fn(x), torch.relu(x) * 2 + 1):
            return f"{backend} compiled a wrong result"
    except Exception as err:  # noqa: BLE001 -- the reason goes back to the test, which skips with it
        lines = str(err).strip().splitlines()
        return f"{type(err).__name__}: {lines[0] if lines else ''}"[:500]
    finally:
        torch._dynamo.reset()
    return None


def _choose_backend() -> tuple[str | None, dict]:
    """The first of ``BACKENDS`` that compiles on every rank, and why each earlier one did not (``{backend:
    reason}``, reasons of all ranks joined). Every rank takes the same decision."""
    failures = {}
    for backend in BACKENDS:
        reason = _probe(backend)
        reasons = [None] * dist.get_world_size()
        dist.all_gather_object(reasons, reason)
        bad = [f"rank {r}: {why}" for r, why in enumerate(reasons) if why is not None]
        if not bad:
            return backend, failures
        failures[backend] = "; ".join(bad)
    return None, failures


class Net(nn.Module):
    """``tests.models.mlp`` in a module class of this file. Compiling a DDP model, dynamo breaks the graph at DDP's
    forward (its ``_inside_ddp_forward`` is on dynamo's skip list) and starts again in the wrapped module's
    forward, which it compiles only when that forward is user code: DDP around a bare ``nn.Sequential`` runs
    eager under ``torch.compile`` (no graph at all, checked on torch 2.13)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        self.layers = models.mlp(seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _train(variant: str, method: str, backend: str) -> dict:
    # DDP's default buckets (one, for this MLP): dynamo's DDP graph splitting asserts that the first bucket
    # (1 MB) is no larger than the cap, so tests.models.SEVERAL_BUCKETS_MB cannot be compiled
    ddp_model = models.ddp(Net())
    torch._dynamo.reset()  # a fresh compile per variant, so the graph count below is this variant's own
    if variant == "eager":
        state, run = gcomp.install(ddp_model, method), ddp_model
    elif variant == "install_then_compile":
        state = gcomp.install(ddp_model, method)
        run = torch.compile(ddp_model, backend=backend)
    else:  # compile_then_install: install finds the DDP model inside the OptimizedModule
        run = torch.compile(ddp_model, backend=backend)
        state = gcomp.install(run, method)
    opt = torch.optim.SGD(ddp_model.parameters(), lr=LR, momentum=MOMENTUM)
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    losses = []
    for step in range(STEPS):
        x, y = models.batch(step, dist.get_rank())
        opt.zero_grad()
        loss = nn.functional.cross_entropy(run(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach().clone())
    return {
        "losses": torch.stack(losses),
        "params": models.flat_params(ddp_model.module).clone(),  # after the last step
        "stats": dict(state.stats),
        "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before,
    }


def job_compile(methods: list[str]) -> dict:
    """``{"backend": the backend used or None, "failures": {backend: why not}, "runs": {method: {variant: run}}}``
    with each run as ``_train`` returns it (this rank)."""
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = 1  # no pool of compile subprocesses in the rank processes
    backend, failures = _choose_backend()
    runs = {}
    if backend is not None:
        try:
            runs = {m: {v: _train(v, m, backend) for v in VARIANTS} for m in methods}
        finally:
            torch._dynamo.reset()
    return {"backend": backend, "failures": failures, "runs": runs}
