"""The small model and data the contract jobs train: a seeded MLP, deterministic batches, plain SGD.

Everything is seeded and nothing is downloaded; the test suite's other helpers (``tests/models.py``) build on
these.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

SEVERAL_BUCKETS_MB = 0.002  # 2 KB caps split the MLP below into several buckets after DDP's rebuild


def mlp(seed: int = 0) -> nn.Module:
    """20 inputs, two hidden layers of 32, 10 outputs; the same weights for the same seed."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))


def batch(step: int, rank: int, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch that differs per step and rank."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(size, 20, generator=g)
    y = torch.randint(0, 10, (size,), generator=g)
    return x, y


def ddp(model: nn.Module, **kwargs) -> DistributedDataParallel:
    return DistributedDataParallel(model, **kwargs)


def train(model: nn.Module, steps: int, start: int = 0, lr: float = 0.1) -> list[torch.Tensor]:
    """Plain SGD on cross-entropy over ``batch(step, rank)``; returns the losses."""
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
