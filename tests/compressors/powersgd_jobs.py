"""Rank jobs for tests/compressors/test_powersgd.py (module-level, so ``run_ranks`` can send them)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

import gcomp
from gcomp.testing.buckets import FakeBucket
from tests import models


def conv_mlp(seed: int = 0) -> nn.Module:
    """Matrices of several shapes, a conv weight (reshaped to out x in*kh*kw) and biases."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 4 * 4, 12), nn.Linear(12, 5))


def _gather(t: torch.Tensor) -> torch.Tensor:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return torch.stack(out)


def job_reduce_buckets(params: dict, steps: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> dict:
    """Random gradients of ``conv_mlp``'s parameters, one bucket, through the hook's path for ``steps`` steps.

    Returns per step the largest deviation of the result from the exact mean of the ranks' gradients, and
    the largest entry of the error buffers after the step (relative to the gradients' scale).
    """
    rank = dist.get_rank()
    model = conv_mlp(seed).to(dtype)
    ddp_model = models.ddp(model)
    state = gcomp.HookState(gcomp.create("powersgd", **params), ddp_model, None)
    state.warmup = 0
    named = list(model.named_parameters())[::-1]
    deviations, errors, results = [], [], []
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        grad = torch.cat([torch.randn(p.numel(), generator=g, dtype=torch.float64) for _, p in named]).to(dtype)
        exact = _gather(grad).double().mean(0)
        result = state.reduce(FakeBucket(grad.clone(), 0, True, [p for _, p in named])).wait()
        results.append(result)
        deviations.append(((result.double() - exact).abs().max() / exact.abs().max()).item())
        held = state.method.state_dict()["compressor"]["errors"]
        errors.append(max((e.abs().max().item() for e in held.values()), default=0.0))
    return {"deviations": deviations, "errors": errors, "results": torch.stack(results),
            "bytes_sent": state.stats["bytes_sent"], "numel": sum(p.numel() for p in model.parameters())}


_TEACHER = 4242


def teacher_batch(step: int, rank: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable task for the tests' MLP: labels from a fixed random linear teacher; a batch per step and rank."""
    x = torch.randn(size, 20, generator=torch.Generator().manual_seed(100_000 * step + rank))
    return x, models.teacher_labels(x, seed=_TEACHER)


def _train(model, steps: int, lr: float, counter) -> dict:
    """SGD on the teacher task; losses (this rank's batch), final parameters, what ``counter()`` grew by per step."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    rank = dist.get_rank()
    losses, sent = [], []
    for step in range(steps):
        before = counter()
        x, y = teacher_batch(step, rank)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
        sent.append(counter() - before)
    return {"losses": torch.stack(losses), "params": models.flat_params(model.module).clone(), "bytes": sent}


def job_train(method: str | None, params: dict, steps: int, bucket_cap_mb: float | None = None,
              seed: int = 0, lr: float = 0.2) -> dict:
    """Train the tests' MLP with a gcomp method (``None``: plain DDP); losses, parameters, bytes sent per step."""
    kwargs = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    model = models.ddp(models.mlp(seed), **kwargs)
    state = gcomp.install(model, method, **params) if method is not None else None
    out = _train(model, steps, lr, (lambda: state.stats["bytes_sent"]) if state else (lambda: 0))
    out["buckets"] = state.stats["buckets"] if state else None
    return out


def job_train_torch(rank: int, steps: int, start_iter: int = 2, seed: int = 0, lr: float = 0.2) -> dict:
    """The same training with PyTorch's own ``powerSGD_hook`` (one bucket: it deadlocks on gloo with several).

    Bytes per step are PyTorch's own count of what its hook sends (``total_numel_after_compression``: P and Q
    entries plus the uncompressed tensors) times 4 (fp32); before ``start_iter`` it all-reduces the bucket.
    """
    model = models.ddp(models.mlp(seed))
    state = torch_powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                         start_powerSGD_iter=start_iter, min_compression_rate=2,
                                         use_error_feedback=True, warm_start=True, random_seed=seed)
    model.register_comm_hook(state, torch_powersgd.powerSGD_hook)
    numel = sum(p.numel() for p in model.parameters())
    out = _train(model, steps, lr, lambda: 4 * state.total_numel_after_compression)
    out["bytes"] = [4 * numel if step < start_iter else b for step, b in enumerate(out["bytes"])]
    return out


def low_rank_gradient(seed: int = 3) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A one-layer model and a fixed bucket (bias, then a 12 x 16 weight of singular values 3, 1, 0.5).

    Returns the model, the flat bucket and the weight gradient as a matrix."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 12))
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(12, 3, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(16, 3, generator=g, dtype=torch.float64))
    weight = (u * torch.tensor([3.0, 1.0, 0.5], dtype=torch.float64)) @ v.t()
    bias = torch.randn(12, generator=g, dtype=torch.float64)
    return model, torch.cat([bias, weight.reshape(-1)]).float(), weight.float()


def job_fixed_gradient(params: dict, steps: int, nan_at: int = -1) -> dict:
    """The same bucket (``low_rank_gradient``) every step through the hook's path; a NaN in it at ``nan_at``.

    Returns the results and, after each step, the weight's error (n x m) and warm-start Q (empty when absent).
    """
    model, bucket, _ = low_rank_gradient()
    state = gcomp.HookState(gcomp.create("powersgd", **params), models.ddp(model), None)
    state.warmup = 0
    params_in_bucket = [model[0].bias, model[0].weight]
    results, errors, queries = [], [], []
    for step in range(steps):
        grad = bucket.clone().mul_(dist.get_world_size())  # the hook divides by the world size
        if step == nan_at:
            grad[20] = float("nan")
        results.append(state.reduce(FakeBucket(grad, 0, True, params_in_bucket)).wait().clone())
        held = state.method.state_dict()["compressor"]
        errors.append(held["errors"]["0.weight"].view(12, 16) if "errors" in held else torch.zeros(0))
        queries.append(held["queries"].get("0.weight", torch.zeros(0)).clone())
    return {"results": torch.stack(results), "errors": errors, "queries": queries,
            "state": state.method.compressor.state_dict()}
