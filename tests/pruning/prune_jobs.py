"""Rank jobs for tests/pruning/test_prune.py (module-level, so ``tests.distributed.run_ranks`` can send them)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from gcomp.pruning import prune
from gcomp.pruning import check_masks_agree


def noisy_model(rank: int, src: int) -> nn.Module:
    """The same model on every rank, plus rank-specific weight noise on every rank but ``src``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 3))
    if rank != src:
        g = torch.Generator().manual_seed(100 + rank)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5 * torch.randn(p.shape, generator=g))
    return model


def rank_data(rank: int, src: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1 if rank == src else 50 + rank)
    return torch.randn(30, 6, generator=g), torch.arange(30) % 3


def rank_kwargs(rank: int, src: int, method: str) -> dict:
    """Different data and seed off ``src``; some ranks have no data at all (GraSP needs it only on ``src``)."""
    data = rank_data(rank, src)
    if method == "grasp" and rank not in (src, 1):
        data = None
    return {"data": data, "seed": 0 if rank == src else 100 + rank}


def prune_with_rank_noise(configs) -> list:
    rank = dist.get_rank()
    out = []
    for method, scope, ratio, src in configs:
        model = noisy_model(rank, src)
        result = prune(model, ratio, method, scope=scope, src=src, **rank_kwargs(rank, src, method))
        zeroed = all(bool((model.get_submodule(name.rpartition(".")[0]).weight_orig[mask == 0] == 0).all())
                     for name, mask in result.masks.items())
        out.append((result.digest, {k: v.clone() for k, v in result.masks.items()}, zeroed))
    return out


def _error(fn) -> str:
    try:
        fn()
    except (RuntimeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def disagreements() -> dict:
    rank = dist.get_rank()
    same = check_masks_agree([torch.ones(3, 4), torch.tensor([1.0, 0.0, 1.0])])
    mask = torch.ones(10)
    mask[rank % 2] = 0
    width = 12 if rank != 1 else 13
    model = nn.Sequential(nn.Linear(6, width), nn.ReLU(), nn.Linear(width, 3))
    return {
        "same": same,
        "different": _error(lambda: check_masks_agree([mask])),
        "sizes": _error(lambda: prune(model, 0.5, "magnitude")),
        "src_failed": _error(lambda: prune(nn.Linear(4, 2), 0.5, "grasp")),
    }


def one_rank_skips(skip: int, timeout: float) -> dict:
    """Rank ``skip`` does not call prune: the others' errors and how long they took; then every rank calls it
    (after a barrier, so the skipping rank's call is not taken for the others' first): its digest; then rank
    ``skip`` passes another ratio: every rank's error."""
    import time

    rank = dist.get_rank()
    out = {"skipped": None, "seconds": 0.0}
    if rank != skip:
        start = time.monotonic()
        out["skipped"] = _error(lambda: prune(noisy_model(0, 0), 0.5, "magnitude", enter_timeout=timeout))
        out["seconds"] = time.monotonic() - start
    dist.barrier()
    out["all"] = prune(noisy_model(0, 0), 0.5, "magnitude", enter_timeout=timeout).digest
    ratio = 0.6 if rank == skip else 0.5
    out["disagree"] = _error(lambda: prune(noisy_model(0, 0), ratio, "magnitude", enter_timeout=timeout))
    out["after"] = prune(noisy_model(0, 0), 0.5, "random", enter_timeout=timeout).digest
    return out
