"""The dense reference is the bucket's own dtype (bf16 parameters: ``bf16`` and ``fp16`` save nothing, and
say so), and autocast changes nothing for the hook (gradients of fp32 parameters stay fp32)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import gcomp
from tests.distributed import run_ranks
from tests.models import batch, ddp, mlp


def _ratios(dtype: torch.dtype, autocast: bool) -> dict:
    out = {}
    for name, params in (("bf16", {}), ("fp16", {}), ("topk", {"ratio": 0.05})):
        model = ddp(mlp(0).to(dtype))
        state = gcomp.install(model, name, **params)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            x, y = batch(step, torch.distributed.get_rank())
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = nn.functional.cross_entropy(model(x.to(dtype)), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        out[name] = (state.compression_ratio, state.stats["bytes_dense"],
                     sum(p.numel() for p in model.parameters()) * 3 * torch.finfo(dtype).bits // 8,
                     bool(torch.isfinite(loss)))
    return out


@pytest.mark.parametrize("dtype,autocast", [(torch.bfloat16, False), (torch.float32, True)],
                         ids=["bf16-parameters", "fp32-under-bf16-autocast"])
def test_compression_is_counted_against_a_dense_all_reduce_of_the_buckets_dtype(dtype, autocast):
    for ratios in run_ranks(2, _ratios, dtype, autocast):
        for name, (ratio, dense, expected_dense, finite) in ratios.items():
            assert dense == expected_dense, (name, dense, expected_dense)
            assert finite, name
        if dtype == torch.bfloat16:
            assert ratios["bf16"][0] == pytest.approx(1.0) and ratios["fp16"][0] == pytest.approx(1.0)
        else:
            assert ratios["bf16"][0] == pytest.approx(2.0) and ratios["fp16"][0] == pytest.approx(2.0)
        assert ratios["topk"][0] > 2.0
