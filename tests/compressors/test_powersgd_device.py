"""``powersgd`` on its device path (``gcomp.kernels.forced``, on CPU tensors; ``gcomp.compressors.powersgd_batched``):
the same results as the CPU path within rounding, step after step (it is deterministic given the same warm start),
on 2 simulated ranks; checkpoints that either path reads; and a number of operations that grows with the number
of distinct matrix shapes at most, never with the number of matrices or entries."""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from gcomp import BucketInfo, kernels
from gcomp.compressors.powersgd import PowerSGDCompressor
from gcomp.testing.ops import counting

STEPS = 4


def _model(repeat: int = 3, shapes: int = 2) -> nn.Module:
    """``shapes`` distinct Linear shapes, ``repeat`` layers of each (their weights compressed, their biases dense),
    then a conv weight of a shape of its own."""
    torch.manual_seed(0)
    layers = [nn.Linear(24 + 8 * s, 16 + 4 * s) for s in range(shapes) for _ in range(repeat)]
    return nn.Sequential(*layers, nn.Conv2d(3, 8, 3))


def _bucket(model: nn.Module, dtype: torch.dtype) -> BucketInfo:
    named = list(model.named_parameters())[::-1]
    return BucketInfo.from_layout(0, dtype, [n for n, _ in named], [p.numel() for _, p in named])


def _compressors(model, world: int, **params) -> list[PowerSGDCompressor]:
    comps = [PowerSGDCompressor(**params) for _ in range(world)]
    for c in comps:
        c.bind(model, None, {})
    return comps


def _step(comps, info: BucketInfo, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """One step of every simulated rank: both SUM rounds computed here; what each rank decoded."""
    payloads = [c.compress(g.clone(), info) for c, g in zip(comps, grads)]
    summed = torch.stack([p.tensors[0] for p in payloads]).sum(0)
    for c, p in zip(comps, payloads):
        p.tensors[0] = summed.clone()
        c.second_round(p)
    q = torch.stack([p.tensors[1] for p in payloads]).sum(0)
    return [c.decompress([p.tensors[0], q.clone()], p.ctx) for c, p in zip(comps, payloads)]


def _grads(info: BucketInfo, step: int, world: int, dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.randn(info.numel, generator=torch.Generator().manual_seed(100 * step + r)).to(dtype) / world
            for r in range(world)]


def _run(device: bool, dtype: torch.dtype, steps: int = STEPS, comps=None, start: int = 0, **params):
    model = _model()
    info = _bucket(model, dtype)
    comps = comps or _compressors(model, 2, **params)
    results = []
    with kernels.forced() if device else contextlib.nullcontext():
        for step in range(start, start + steps):
            results.append(_step(comps, info, _grads(info, step, 2, dtype)))
    return results, comps


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    tol = {torch.float32: 1e-4, torch.float64: 1e-10, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("rank", [1, 3])
def test_the_device_path_equals_the_cpu_path_within_rounding(dtype, rank):
    """Step after step on 2 ranks: the decoded bucket, and what each path keeps (errors, warm-start queries, by
    parameter name)."""
    (device, dev_comps), (cpu, cpu_comps) = _run(True, dtype, rank=rank), _run(False, dtype, rank=rank)
    for step_dev, step_cpu in zip(device, cpu):
        for d, c in zip(step_dev, step_cpu):
            assert d.dtype == c.dtype == dtype
            _close(d, c, dtype)
    for dev, cpu_ in zip(dev_comps, cpu_comps):
        assert dev._errors.keys() == cpu_._errors.keys() and dev._queries.keys() == cpu_._queries.keys()
        for name in cpu_._errors:
            _close(dev._errors[name], cpu_._errors[name], torch.float64 if dtype == torch.float64 else torch.float32)
            _close(dev._queries[name], cpu_._queries[name], torch.float64 if dtype == torch.float64 else torch.float32)


@pytest.mark.parametrize("saved_on, resumed_on", [(True, False), (False, True)], ids=["device-to-cpu", "cpu-to-device"])
def test_a_checkpoint_of_one_path_resumes_on_the_other(saved_on, resumed_on):
    """The state (errors and queries by name) is the same format on both paths: a run saved on one path goes on,
    on the other, as it would have gone on where it was saved."""
    _, comps = _run(saved_on, torch.float32, steps=2)
    states = [c.state_dict() for c in comps]
    onward, _ = _run(saved_on, torch.float32, steps=2, comps=comps, start=2)
    model = _model()
    resumed = _compressors(model, 2)
    for c, state in zip(resumed, states):
        c.load_state_dict(state)
    other, _ = _run(resumed_on, torch.float32, steps=2, comps=resumed, start=2)
    for step_a, step_b in zip(onward, other):
        for a, b in zip(step_a, step_b):
            _close(a, b, torch.float32)


def test_without_warm_start_the_ranks_still_agree():
    """Fresh queries each step: one draw per shape from the query generator on the device path (other numbers than
    the CPU path's draws, matrix by matrix), the same on every rank."""
    device, _ = _run(True, torch.float32, warm_start=False)
    for step in device:
        assert torch.equal(step[0], step[1]) and torch.isfinite(step[0]).all()


def _ops(repeat: int, shapes: int) -> int:
    model = _model(repeat, shapes)
    info = _bucket(model, torch.float32)
    comps = _compressors(model, 1)
    with kernels.forced():
        _step(comps, info, _grads(info, 0, 1, torch.float32))  # stacks and first queries are made once
        with counting() as counter:
            _step(comps, info, _grads(info, 1, 1, torch.float32))
    assert not counter.syncs
    return sum(counter.ops.values())


def test_operations_grow_with_distinct_shapes_only():
    """2 matrices of each shape or 24: the same count; one more shape adds a bounded number."""
    assert _ops(2, 2) == _ops(24, 2)
    assert _ops(2, 3) == _ops(24, 3) <= _ops(2, 2) + 60
