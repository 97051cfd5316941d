"""Fake DDP buckets, how the contract jobs split a model into them, and the gradients they hold."""
from __future__ import annotations

import torch

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
LAYOUTS = ("one", "several")


def dtype_name(dtype: torch.dtype) -> str:
    """``"float16"`` for ``torch.float16``."""
    return str(dtype).removeprefix("torch.")


class FakeBucket:
    """What ``HookState.reduce`` reads of a ``dist.GradBucket``."""

    def __init__(self, buffer: torch.Tensor, index: int, last: bool, params: list[torch.nn.Parameter]):
        self._buffer, self._index, self._last, self._params = buffer, index, last, params

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last

    def parameters(self) -> list[torch.nn.Parameter]:
        return self._params


def bucket_groups(model: torch.nn.Module, layout: str) -> list[list[torch.nn.Parameter]]:
    """Parameters per bucket in DDP's backward order: all in one (``"one"``), or in two (``"several"``)."""
    params = list(model.parameters())[::-1]
    if layout == "one":
        return [params]
    half = len(params) // 2
    return [params[:half], params[half:]]


def fake_gradient(params, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A flat gradient whose parameters have magnitudes from 1e-3 to 1e3 (fp16-safe after summing 8 ranks)."""
    g = torch.Generator().manual_seed(seed)
    pieces = []
    for p in params:
        scale = 10.0 ** (6 * torch.rand((), generator=g, dtype=torch.float64) - 3)
        pieces.append(torch.randn(p.numel(), generator=g, dtype=torch.float64) * scale)
    return torch.cat(pieces).to(dtype)
