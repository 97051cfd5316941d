"""PyTorch's hooks in the bench: a combination that cannot run is refused when the hook is made, with why."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gcomp.bench.methods import TorchHook


def _model_on(device: str):
    return SimpleNamespace(parameters=lambda: iter([torch.zeros(1, device=device)]),
                           register_comm_hook=lambda state, hook: None)


def test_torch_powersgd_on_cpu_tensors_is_refused_where_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match="torch.cuda.synchronize.*--device cuda"):
        TorchHook("torch:powersgd", _model_on("cpu"))


def test_torch_powersgd_on_cpu_tensors_is_made_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert TorchHook("torch:powersgd", _model_on("cpu")).name == "torch:powersgd"
