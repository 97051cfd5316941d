"""``randomk``'s device path (``gcomp.kernels.forced``): positions drawn bucket-wide on the device, alike on every rank,
distinct, ascending and uniform; the host's generator untouched; FSDP2's rows at once; the flag still surfaces a
non-finite entry; error feedback conserves; checkpoints resume the device stream bit for bit and leave the CPU
path's format as it was; no host synchronisation (``gcomp.testing.ops.counting``)."""
from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gcomp
from gcomp import BucketInfo, kernels
from gcomp.compressors.device_random import DeviceStream, uniform_subsets
from gcomp.compressors.randomk import RandomKCompressor
from gcomp.testing.ops import counting
from tests.compressors.test_randomk import _chi2_bound

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _drawn(comp: RandomKCompressor, x: torch.Tensor) -> torch.Tensor:
    with kernels.forced():
        return comp.compress(x, BucketInfo.single(x)).ctx.index


@PROPERTY
@given(n=st.integers(1, 5000), ratio=st.floats(1e-4, 1.0), seed=st.integers(0, 2**31 - 1))
def test_every_rank_draws_the_same_distinct_ascending_positions_on_the_device(n, ratio, seed):
    ranks = [RandomKCompressor(ratio, seed) for _ in range(3)]
    cpu_state = ranks[0].generator.get_state()
    k = max(1, int(n * ratio))
    drawn = []
    for step in range(3):
        x = torch.randn(n, generator=torch.Generator().manual_seed(step))
        index = [_drawn(comp, x) for comp in ranks]
        assert all(torch.equal(i, index[0]) for i in index), f"step {step}: ranks drew different positions"
        index = index[0]
        assert index.dtype == torch.int64 and index.shape == (k,)
        assert bool((index[1:] > index[:-1]).all()) and 0 <= int(index[0]) and int(index[-1]) < n
        drawn.append(index)
    assert torch.equal(ranks[0].generator.get_state(), cpu_state)  # nothing drawn on the host
    if math.comb(n, k) > 10**6:  # the same subset twice would be a coincidence: the stream moves on
        assert not torch.equal(drawn[0], drawn[1])


@pytest.mark.parametrize("n, k", [(12, 2), (12, 3), (6, 2), (6, 5)])
def test_device_draws_give_every_k_subset_equally_often(n, k):
    """100 draws expected per k-subset, all drawn in one call (a row each), as FSDP2's rows are."""
    cells = {c: i for i, c in enumerate(itertools.combinations(range(n), k))}
    rows = uniform_subsets(100 * len(cells), n, k, torch.Generator().manual_seed(5))
    counts = torch.zeros(len(cells))
    for row in rows.tolist():
        counts[cells[tuple(row)]] += 1  # a KeyError if not ascending and distinct
    chi2 = float(((counts - 100) ** 2 / 100).sum())
    assert chi2 < _chi2_bound(len(cells) - 1), chi2


def test_the_compressor_draws_uniformly_on_the_device():
    """The same, through ``compress``: one draw per bucket, the stream re-seeded for each."""
    n, k = 8, 2
    cells = {c: i for i, c in enumerate(itertools.combinations(range(n), k))}
    comp = RandomKCompressor(k / n, 11)
    counts = torch.zeros(len(cells))
    x = torch.randn(n)
    for _ in range(100 * len(cells)):
        counts[cells[tuple(_drawn(comp, x).tolist())]] += 1
    chi2 = float(((counts - 100) ** 2 / 100).sum())
    assert chi2 < _chi2_bound(len(cells) - 1), chi2


@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), float("-inf")])
def test_a_nonfinite_entry_not_drawn_surfaces_on_every_sent_entry(bad):
    comps = [RandomKCompressor(0.1, 0) for _ in range(2)]
    xs = [torch.randn(100), torch.randn(100)]
    index = _drawn(RandomKCompressor(0.1, 0), xs[0])
    if bad is not None:
        xs[1][int(torch.ones(100, dtype=torch.bool).index_fill_(0, index, False).nonzero()[0])] = bad
    with kernels.forced():
        payloads = [c.compress(x, BucketInfo.single(x)) for c, x in zip(comps, xs)]
        out = comps[0].decompress([payloads[0].tensors[0] + payloads[1].tensors[0]], payloads[0].ctx)
    assert torch.equal(payloads[0].ctx.index, index)
    assert out[index].isnan().all() == (bad is not None) and out[index].isfinite().all() == (bad is None)


@pytest.mark.parametrize("dtype", DTYPES)
def test_error_feedback_conserves_on_the_device_path(dtype):
    method = gcomp.create("randomk", ratio=0.1)
    comp, memory = method.compressor, method.memory
    info = BucketInfo.from_layout(0, dtype, ["a", "b"], [300, 40])
    g = torch.Generator().manual_seed(4)
    for step in range(4):
        grad = torch.randn(info.numel, generator=g, dtype=torch.float64).to(dtype)
        if step == 2:
            grad[7] = float("inf")
        with kernels.forced():
            v = memory.compensate(grad, info)
            payload = comp.compress(v, info)
            assert comp.sent_positions(payload) is None  # finiteness stays on the device
            memory.update(v, info, comp, payload)
            new = memory.compensate(torch.zeros_like(grad), info)
            sent = comp.decompress(payload.tensors, payload.ctx)
        assert torch.equal(new, torch.nan_to_num(v - sent, nan=0.0, posinf=0.0, neginf=0.0))
        assert new.isfinite().all() and new.count_nonzero() > 0.8 * info.numel


def test_a_checkpoint_resumes_the_device_draws_and_the_cpu_format_stays():
    x = torch.randn(1000)
    a = RandomKCompressor(0.05, 3)
    assert set(a.state_dict()) == {"generator"}  # a CPU-path checkpoint, as before
    _drawn(a, x)
    state = a.state_dict()
    assert state["device_stream"] == {"seed": 3, "draws": 1}
    b = RandomKCompressor(0.05, 99)
    b.load_state_dict(state)
    assert torch.equal(_drawn(a, x), _drawn(b, x))
    b.load_state_dict({"generator": state["generator"]})  # an old checkpoint: the device stream starts afresh
    assert torch.equal(_drawn(b, x), _drawn(RandomKCompressor(0.05, 99), x))
    for bad in ({"seed": 3}, {"seed": 3, "draws": -1}, {"seed": "3", "draws": 1}):
        with pytest.raises(ValueError, match="device stream"):
            b.load_state_dict({**state, "device_stream": bad})


def test_rows_are_drawn_at_once_and_alike_on_every_rank():
    rows, width, k = 4, 250, 25
    x = torch.randn(rows * width)
    comps = [RandomKCompressor(0.1, 2) for _ in range(2)]
    with kernels.forced():
        payloads = [c.compress_rows(x, BucketInfo.single(x), rows) for c in comps]
    assert all(c.device_stream.draws == 1 for c in comps)
    index = payloads[0].ctx.index.view(rows, k)
    assert torch.equal(index, payloads[1].ctx.index.view(rows, k))
    offsets = torch.arange(rows)[:, None] * width
    assert ((index >= offsets) & (index < offsets + width)).all() and (index.diff(dim=1) > 0).all()
    wire, = payloads[0].tensors
    assert wire.shape == (rows, k + 1) and torch.equal(wire[:, :k], x[index]) and not wire[:, k].any()


def test_the_device_path_never_waits_for_the_host():
    x = torch.randn(1 << 16)
    comp = RandomKCompressor(0.01, 0)
    with kernels.forced(), counting() as counter:
        payload = comp.compress(x, BucketInfo.single(x))
        comp.residual_into(torch.empty_like(x), x, payload)
        comp.decompress(payload.tensors, payload.ctx)
    assert counter.syncs == {} and counter.ops["topk"] == 1


def test_a_stream_is_seeded_afresh_per_draw():
    stream = DeviceStream(5, "randomk")
    first = torch.rand(4, generator=stream.next("cpu"))
    second = torch.rand(4, generator=stream.next("cpu"))
    again = DeviceStream(5, "randomk")
    again.load_state_dict({"seed": 5, "draws": 1})
    assert not torch.equal(first, second) and torch.equal(torch.rand(4, generator=again.next("cpu")), second)
