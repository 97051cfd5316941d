"""``fp16`` and ``bf16`` against references: PyTorch's own fp16 hook, and a hand-built bf16 all-reduce."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

import gcomp
from tests.distributed import run_ranks
from tests.models import batch, ddp, flat_grads, flat_params, mlp

LR = 0.1
STEPS = 5
U16 = 2.0 ** -11  # unit roundoff of float16 (half its eps)
TINY16 = 2.0 ** -24  # smallest float16 subnormal: the absolute rounding step near zero


def _step(model: nn.Module, step: int) -> torch.Tensor:
    """Forward and backward on this rank's batch; returns the (reduced, for DDP) flat gradient."""
    model.zero_grad(set_to_none=True)
    x, y = batch(step, dist.get_rank())
    nn.functional.cross_entropy(model(x), y).backward()
    return flat_grads(model)


def _sgd(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(LR * p.grad)


def _local_gradient() -> torch.Tensor:
    """This rank's own gradient at step 0, in ``parameters()`` order: the layout of DDP's first bucket."""
    return _step(mlp(0), 0)


def _fp16_vs_pytorch(steps: int) -> dict:
    world = dist.get_world_size()
    g = _local_gradient()
    magnitude = g.abs()
    dist.all_reduce(magnitude)
    exact = g.double()
    dist.all_reduce(exact)

    ours = ddp(mlp(0))
    gcomp.install(ours, "fp16")
    theirs = ddp(mlp(0))
    theirs.register_comm_hook(None, fp16_compress_hook)
    first = []
    for step in range(steps):
        pair = [_step(model, step) for model in (ours, theirs)]
        if step == 0:
            first = pair
        for model in (ours, theirs):
            _sgd(model)
    return {"ours": first[0], "theirs": first[1], "exact": (exact / world), "scale": magnitude / world,
            "params": (flat_params(ours), flat_params(theirs))}


def _bf16_vs_reference(steps: int) -> dict:
    world = dist.get_world_size()
    # g / N as DDP's reducer (and so the hook) rounds it: a multiplication by 1/N; a true division can differ
    # by one fp32 ulp, which now and then lands on the other side of a bf16 rounding boundary.
    reference = _local_gradient().mul(1.0 / world).to(torch.bfloat16)
    dist.all_reduce(reference)  # summed in bf16 by the same collective, same size, same order
    model = ddp(mlp(0))
    state = gcomp.install(model, "bf16")
    first = _step(model, 0)
    _sgd(model)
    for step in range(1, steps):
        _step(model, step)
        _sgd(model)
    return {"ours": first, "reference": reference.float(), "params": flat_params(model),
            "sent": state.stats["bytes_sent"], "dense": state.stats["bytes_dense"]}


@pytest.mark.parametrize("world", [2, 3])
def test_fp16_matches_pytorchs_fp16_compress_hook(world):
    results = run_ranks(world, _fp16_vs_pytorch, STEPS)
    for r in results:
        ours, theirs, exact, scale = r["ours"], r["theirs"], r["exact"], r["scale"]
        assert ours.dtype == torch.float32 and ours.shape == theirs.shape
        # Each way rounds every rank's term twice (scale, cast) and the float16 sum N-1 times, each rounding
        # within U16 relative (or TINY16/2 absolute among the subnormals): that bounds each way's distance
        # to the exact mean, and twice that bounds their distance to each other.
        one_way = (world + 1) * U16 * scale * 1.001 + world * TINY16
        assert torch.all((ours.double() - exact).abs() <= one_way + 1e-7 * exact.abs())
        assert torch.all((ours - theirs).abs() <= 2 * one_way), (ours - theirs).abs().max()
        # it really went through float16: every value is a float16 value, and not all are the fp32 mean
        assert torch.equal(ours.half().float(), ours)
        assert not torch.equal(ours, exact.float())
        ours_p, theirs_p = r["params"]
        torch.testing.assert_close(ours_p, theirs_p, rtol=0, atol=1e-4)
    for r in results[1:]:
        assert torch.equal(r["ours"], results[0]["ours"])
        assert torch.equal(r["params"][0], results[0]["params"][0])


@pytest.mark.parametrize("world", [2, 3])
def test_bf16_matches_a_bfloat16_all_reduce(world):
    results = run_ranks(world, _bf16_vs_reference, STEPS)
    for r in results:
        assert r["ours"].dtype == torch.float32
        assert torch.equal(r["ours"], r["reference"])
        assert 2 * r["sent"] == r["dense"]
    for r in results[1:]:
        assert torch.equal(r["params"], results[0]["params"])


@pytest.mark.parametrize("name, dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_the_cast_is_a_pure_pair_that_keeps_no_state(name, dtype):
    """encode casts and hands the state back untouched; decode casts the sum back to the bucket's dtype; a bucket
    already in the wire's dtype goes as it is."""
    compressor = gcomp.create(name).compressor
    first = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    info = gcomp.BucketInfo.single(first)
    payload, state = compressor.encode(first, {}, info)
    wire = payload.tensors[0]
    assert state == {} and wire.dtype == dtype and torch.equal(wire, first.to(dtype))
    out = compressor.decode([wire * 2], payload.ctx)
    assert out.dtype == torch.float32 and torch.equal(out, (wire * 2).float())
    half = torch.ones(8, dtype=dtype)
    assert compressor.encode(half, {}, gcomp.BucketInfo.single(half))[0].tensors[0] is half
    assert compressor.traits.wire_bytes(info, 4) == 2000 and not compressor.traits.lossless
