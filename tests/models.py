"""Small models and data shared by the tests; everything seeded, nothing downloaded."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

SEVERAL_BUCKETS_MB = 0.002  # 2 KB caps split the MLP below into several buckets after DDP's rebuild


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))


def batch(step: int, rank: int, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch that differs per step and rank."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(size, 20, generator=g)
    y = torch.randint(0, 10, (size,), generator=g)
    return x, y


def teacher_labels(x: torch.Tensor, seed: int) -> torch.Tensor:
    """Labels of ``x`` (rows of 20 inputs, as ``mlp`` takes) from a fixed random linear teacher: a task the MLP
    can learn, unlike the random labels of ``batch``; convergence smoke tests train on it."""
    teacher = torch.randn(20, 10, generator=torch.Generator().manual_seed(seed))
    return (x @ teacher).argmax(1)


def ddp(model: nn.Module, **kwargs) -> DistributedDataParallel:
    return DistributedDataParallel(model, **kwargs)


def train(model: nn.Module, steps: int, start: int = 0, lr: float = 0.1) -> list[float]:
    """Plain SGD on cross-entropy; returns the losses."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.0)
    rank = dist.get_rank()
    losses = []
    for step in range(start, start + steps):
        x, y = batch(step, rank)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


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
