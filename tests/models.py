"""Small models and data shared by the tests; everything seeded, nothing downloaded.

The model, batches and training loop the contract jobs use live in ``gcomp.testing.models`` (re-exported here);
this file adds what only the tests need.
"""
from __future__ import annotations

import torch
from torch import nn

from gcomp.testing.models import SEVERAL_BUCKETS_MB, batch, ddp, flat_params, mlp, train  # noqa: F401


def teacher_labels(x: torch.Tensor, seed: int) -> torch.Tensor:
    """Labels of ``x`` (rows of 20 inputs, as ``mlp`` takes) from a fixed random linear teacher: a task the MLP
    can learn, unlike the random labels of ``batch``; convergence smoke tests train on it."""
    teacher = torch.randn(20, 10, generator=torch.Generator().manual_seed(seed))
    return (x @ teacher).argmax(1)


def flat_grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.detach().reshape(-1).clone() for p in model.parameters()])


def run_example(cmd: list[str], cwd=None) -> str:
    """Run an example's command; its stdout and stderr, or an assertion with their tail if it failed."""
    import subprocess

    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=cwd)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    return out


def load_parameters(path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def assert_same_parameters(*paths) -> None:
    """Every file holds the same parameter names and, bit for bit, the same values."""
    first, *rest = [load_parameters(p) for p in paths]
    for other, path in zip(rest, paths[1:]):
        assert other.keys() == first.keys(), path
        differ = [k for k in first if not torch.equal(first[k], other[k])]
        assert not differ, f"{path}: {differ} differ from {paths[0]}"
