"""The small models and data the contract jobs train: a seeded MLP, deterministic batches, plain SGD, and the
MLP of odd sizes FSDP2 shards (padded on 2-4 ranks). Everything is seeded; nothing is downloaded."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

SEVERAL_BUCKETS_MB = 0.002  # 2 KB caps split the MLP below into several buckets after DDP's rebuild
FSDP_SIZES = ((11, 13), (13, 7), (7, 3))


def mlp(seed: int = 0) -> nn.Module:
    """20 inputs, two hidden layers of 32, 10 outputs; the same weights for the same seed."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))


def fsdp_mlp(pruned: bool, seed: int = 0) -> nn.Module:
    """Linear layers of ``FSDP_SIZES``, the first two pruned by half (before ``fully_shard``) when asked, each
    layer and the root sharded on every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    layers = [nn.Linear(fan_in, fan_out) for fan_in, fan_out in FSDP_SIZES]
    model = nn.Sequential(*layers)
    if pruned:
        for layer in layers[:2]:
            nn.utils.prune.l1_unstructured(layer, "weight", 0.5)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batch(step: int, rank: int, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch that differs per step and rank."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(size, 20, generator=g), torch.randint(0, 10, (size,), generator=g)


def ddp(model: nn.Module, **kwargs) -> DistributedDataParallel:
    return DistributedDataParallel(model, **kwargs)


def train(model: nn.Module, steps: int, start: int = 0, lr: float = 0.1) -> list[torch.Tensor]:
    """Plain SGD on cross-entropy over ``batch(step, rank)``; returns the losses."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.0)
    losses = []
    for step in range(start, start + steps):
        x, y = batch(step, dist.get_rank())
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])
