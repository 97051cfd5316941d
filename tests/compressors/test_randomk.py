"""``randomk``: the same positions on every rank (one seed, advanced alike), values alone summed, error-feedback
conservation, the non-finite flag, the generator in the checkpoint, a 4-rank convergence smoke test.

This file also holds ``converge_job``, the convergence smoke test the sparse methods' tests share.
"""
from __future__ import annotations

import itertools
import math
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import gcomp
from gcomp import BucketInfo, kernels
from gcomp.compressors.randomk import RandomKCompressor, all_finite, uniform_subset
from tests.distributed import run_ranks
from tests.models import ddp, flat_params, mlp, teacher_labels

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --- the convergence smoke test shared by randomk, threshold and dgc -------------------------------------------

CONVERGE_STEPS, CONVERGE_LR = 40, 0.5


def teacher_batch(step: int, rank: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable task (labels from a fixed linear teacher), fresh samples per step and rank."""
    g = torch.Generator().manual_seed(10_000 + 1000 * step + rank)
    x = torch.randn(size, 20, generator=g)
    return x, teacher_labels(x, seed=123)


def converge_job(configs: list[tuple[str, dict]], steps: int = CONVERGE_STEPS, lr: float = CONVERGE_LR) -> list:
    """Train the example MLP with each ``(method, params)`` (plain SGD, several buckets); per config the
    held-out loss before and after, the hook's stats, and whether every rank ended with the same parameters."""
    out = []
    for name, params in configs:
        net = ddp(mlp(0), bucket_cap_mb=0.002)
        state = gcomp.install(net, name, **params)
        opt = torch.optim.SGD(net.parameters(), lr=lr)
        x_eval, y_eval = teacher_batch(-1, 0, 512)

        def held_out() -> float:
            with torch.no_grad():
                return nn.functional.cross_entropy(net.module(x_eval), y_eval).item()

        first = held_out()
        for step in range(steps):
            x, y = teacher_batch(step, dist.get_rank())
            opt.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
        mine = flat_params(net.module)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        out.append({"first": first, "last": held_out(), "stats": dict(state.stats),
                    "same": all(torch.equal(p, mine) for p in every)})
    return out


def check_convergence(configs: list[tuple[str, dict, float]]) -> list[dict]:
    """Run ``identity`` and each ``(method, params, min_drop)`` on 4 ranks; each must lower the held-out loss
    by at least ``min_drop`` (identity: 0.7; it drops 2.32 -> 1.44 in 40 steps)."""
    ranks = run_ranks(4, converge_job, [("identity", {})] + [(n, p) for n, p, _ in configs])
    runs = ranks[0]
    dense = runs[0]
    assert dense["first"] - dense["last"] >= 0.7, dense
    for i, (name, params, min_drop) in enumerate(configs, start=1):
        run = runs[i]
        assert all(r[i]["same"] for r in ranks), f"{name}{params}: replicas differ"
        assert run["first"] == dense["first"]
        drop = run["first"] - run["last"]
        assert drop >= min_drop, (f"{name}{params}: loss {run['first']:.3f} -> {run['last']:.3f}, "
                                  f"wanted a drop >= {min_drop}")
        assert run["stats"]["bytes_sent"] < run["stats"]["bytes_dense"], run["stats"]
    return runs


# --- the codec --------------------------------------------------------------------------------------------------

def _k(n: int, ratio: float) -> int:
    return max(1, int(ratio * n))


@PROPERTY
@given(n=st.integers(1, 3000), ratio=st.floats(1e-4, 1.0), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**31 - 1))
def test_every_rank_draws_the_same_distinct_positions(n, ratio, dtype, seed):
    ranks = [RandomKCompressor(ratio, seed) for _ in range(3)]
    g = torch.Generator().manual_seed(seed)
    for step in range(3):
        payloads = []
        for comp in ranks:
            x = torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
            payloads.append((x, comp.compress(x, BucketInfo.single(x))))
        k = _k(n, ratio)
        index = payloads[0][1].ctx.index
        assert index.shape == (k,) and bool((index[1:] > index[:-1]).all())  # distinct, ascending
        assert 0 <= int(index.min()) and int(index.max()) < n
        for x, p in payloads:
            assert torch.equal(p.ctx.index, index), f"step {step}: ranks drew different positions"
            wire, = p.tensors
            assert wire.dtype == dtype and wire.shape == (k + 1,) and p.nbytes == (k + 1) * x.element_size()
            assert torch.equal(wire[:k], x[index]) and wire[k] == 0


def test_positions_change_from_step_to_step_and_with_the_seed():
    x = torch.randn(1000)
    a, b = RandomKCompressor(0.05, 0), RandomKCompressor(0.05, 1)
    first = a.compress(x, BucketInfo.single(x)).ctx.index
    second = a.compress(x, BucketInfo.single(x)).ctx.index
    other = b.compress(x, BucketInfo.single(x)).ctx.index
    assert not torch.equal(first.sort().values, second.sort().values)
    assert not torch.equal(first.sort().values, other.sort().values)


@PROPERTY
@given(n=st.integers(1, 500), ratio=st.floats(1e-3, 1.0), world=st.integers(1, 8), seed=st.integers(0, 2**31 - 1),
       dtype=st.sampled_from(DTYPES))
def test_decompress_of_the_summed_wire_is_the_sum_of_decompressions(n, ratio, world, seed, dtype):
    """Small integers: every partial sum is exact, so the all-reduce identity holds bit for bit."""
    comps = [RandomKCompressor(ratio, seed) for _ in range(world)]
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randint(-8, 9, (n,), generator=g).to(dtype) for _ in range(world)]
    payloads = [c.compress(x, BucketInfo.single(x)) for c, x in zip(comps, xs)]
    summed = torch.stack([p.tensors[0] for p in payloads]).sum(0)
    total = torch.stack([c.decompress(p.tensors, p.ctx) for c, p in zip(comps, payloads)]).sum(0)
    for c, p in zip(comps, payloads):
        assert torch.equal(c.decompress([summed], p.ctx), total)
    if _k(n, ratio) == n:  # everything drawn: the plain sum
        assert torch.equal(total, torch.stack(xs).sum(0))


@pytest.mark.parametrize("dtype", DTYPES)
def test_error_feedback_conservation_is_exact(dtype):
    method = gcomp.create("randomk", ratio=0.1)
    comp, memory = method.compressor, method.memory
    info = BucketInfo.from_layout(0, dtype, ["a", "b"], [300, 40])
    g = torch.Generator().manual_seed(4)
    old = torch.zeros(info.numel, dtype=dtype)
    for step in range(5):
        grad = torch.randn(info.numel, generator=g, dtype=torch.float64).to(dtype)
        v = memory.compensate(grad, info)
        assert torch.equal(v, grad + old)
        payload = comp.compress(v, info)
        memory.update(v, info, comp, payload)
        new = memory.compensate(torch.zeros_like(grad), info)
        assert torch.equal(comp.decompress(payload.tensors, payload.ctx) + new, v)
        assert new.count_nonzero() > 0.8 * info.numel  # 90% held back
        old = new


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_nonfinite_entry_not_drawn_still_poisons_every_sent_entry(bad):
    comps = [RandomKCompressor(0.1, 0) for _ in range(2)]
    xs = [torch.randn(100), torch.randn(100)]
    index = RandomKCompressor(0.1, 0).compress(xs[0], BucketInfo.single(xs[0])).ctx.index
    hidden = int(torch.ones(100, dtype=torch.bool).index_fill_(0, index, False).nonzero()[0])
    xs[1][hidden] = bad
    payloads = [c.compress(x, BucketInfo.single(x)) for c, x in zip(comps, xs)]
    summed = payloads[0].tensors[0] + payloads[1].tensors[0]
    out = comps[0].decompress([summed], payloads[0].ctx)
    assert out[index].isnan().all() and torch.isfinite(comps[0].decompress(payloads[0].tensors, payloads[0].ctx)).all()


def test_state_dict_resumes_the_draws():
    a = RandomKCompressor(0.1, 3)
    x = torch.randn(500)
    a.compress(x, BucketInfo.single(x))
    state = a.state_dict()
    b = RandomKCompressor(0.1, 99)
    b.load_state_dict(state)
    assert torch.equal(a.compress(x, BucketInfo.single(x)).ctx.index, b.compress(x, BucketInfo.single(x)).ctx.index)
    with pytest.raises(ValueError, match="unexpected"):
        b.load_state_dict({**state, "other": 1})


# --- 4 ranks ----------------------------------------------------------------------------------------------------

def test_randomk_lowers_the_loss_on_4_ranks():
    """Bounds (identity drops 0.88 in 40 steps): ratio 0.3 must drop >= 0.35 (measured 0.64), ratio 0.1 >= 0.15
    (measured 0.33). Wider than dense because each step applies only the drawn fraction of the gradient; the
    rest waits in the residual and arrives, a step or more late, when its position is drawn."""
    check_convergence([("randomk", {"ratio": 0.3}, 0.35), ("randomk", {"ratio": 0.1}, 0.15)])


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 5000), fraction=st.floats(0.0, 1.0), seed=st.integers(0, 2**31 - 1))
def test_uniform_subset_draws_k_distinct_positions_reproducibly(n, fraction, seed):
    k = max(1, int(n * fraction))
    a = uniform_subset(n, k, torch.Generator().manual_seed(seed))
    b = uniform_subset(n, k, torch.Generator().manual_seed(seed))
    assert a.numel() == k and bool((a[1:] > a[:-1]).all()) and int(a[0]) >= 0 and int(a[-1]) < n  # ascending
    assert torch.equal(a, b)  # the same generator state, the same draw: what keeps ranks in step


@settings(max_examples=80, deadline=None)
@given(n=st.integers(4, 3000), fraction=st.floats(0.0, 0.25), seed=st.integers(0, 2**31 - 1))
def test_uniform_subset_is_the_first_k_distinct_values_of_its_stream(n, fraction, seed):
    """The sparse path (``4k <= n``) returns exactly the first ``k`` distinct values of the stream of uniform
    draws it takes from the generator, whatever the rounds: the set whose every k-subset is equally likely.
    Recorded here by watching ``torch.randint``; k up to n/4 makes repeats, and so top-up rounds, common."""
    k = max(1, int(n * fraction))
    draws = []
    real = torch.randint

    def recording(*args, **kwargs):
        out = real(*args, **kwargs)
        draws.append(out)
        return out

    with mock.patch.object(torch, "randint", recording):
        got = uniform_subset(n, k, torch.Generator().manual_seed(seed))
    first = list(dict.fromkeys(torch.cat(draws).tolist()))  # distinct values in order of first draw
    assert len(first) >= k
    assert got.tolist() == sorted(first[:k])


def _chi2_bound(df: int, z: float = 3.719) -> float:
    """The chi-square quantile exceeded with probability about 1e-4 (``z``: the normal one), Wilson-Hilferty."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("n, k", [(12, 2), (12, 3), (6, 2)], ids=["pairs", "triples-with-top-ups", "dense"])
def test_uniform_subset_draws_every_k_subset_equally_often(n, k):
    """Every k-subset about equally often, 100 times each expected: pairs and triples of 12 take the sparse path
    (triples: the first 3 draws repeat a value in 24% of the draws, so the top-up rounds are tested too), pairs
    of 6 the permutation. Positions come ascending, so the subset is the whole outcome."""
    g = torch.Generator().manual_seed(3)
    cells = {c: i for i, c in enumerate(itertools.combinations(range(n), k))}
    counts = torch.zeros(len(cells))
    for _ in range(100 * len(cells)):
        counts[cells[tuple(uniform_subset(n, k, g).tolist())]] += 1  # a KeyError if not ascending and distinct
    chi2 = float(((counts - 100) ** 2 / 100).sum())
    assert chi2 < _chi2_bound(len(cells) - 1), chi2


# --- the fast paths: the flag in one pass, the update without a decode, the decode buffers -----------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), float("-inf")])
def test_the_flag_is_nan_exactly_when_an_entry_is_not_finite(dtype, bad):
    x = torch.full((500,), torch.finfo(dtype).max, dtype=dtype)  # the largest finite values: no false alarm
    x[::2] = -x[::2]
    if bad is not None:
        x[321] = bad
    wire, = RandomKCompressor(0.01, 0).compress(x, BucketInfo.single(x)).tensors
    assert wire[-1].isnan() == (bad is not None) and (bad is not None or wire[-1] == 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_finite_is_exact_when_the_sum_overflows_and_wherever_the_bad_entry_lies(dtype):
    big = torch.full((1000,), torch.finfo(dtype).max, dtype=dtype)  # the sum overflows: min and max decide
    assert all_finite(big) and all_finite(-big) and all_finite(torch.randn(1000).to(dtype))
    for bad in (float("nan"), float("inf"), float("-inf")):
        for where in (0, 7, 517, 999):
            for x in (torch.randn(1000).to(dtype), big.clone()):
                x[where] = bad
                assert not all_finite(x), (bad, where)
    assert not all_finite(torch.tensor([float("inf"), float("-inf")], dtype=dtype))  # inf - inf: NaN, not 0


def test_sent_positions_only_for_a_finite_bucket_on_the_host():
    """On the CPU path; on the device path (``GCOMP_FORCE_DEVICE_PATH``) whether the bucket is finite stays on the
    device, so there are never such positions (the memory takes ``residual_into``)."""
    comp = RandomKCompressor(0.1, 0)
    x = torch.randn(300)
    payload = comp.compress(x, BucketInfo.single(x))
    if kernels.on_device(x):
        assert comp.sent_positions(payload) is None
    else:
        assert torch.equal(comp.sent_positions(payload), payload.ctx.index)
    x[5] = float("inf")
    assert comp.sent_positions(comp.compress(x, BucketInfo.single(x))) is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_into_equals_the_compensated_bucket_less_the_decoded_payload(dtype):
    comp = RandomKCompressor(0.1, 0)
    info = BucketInfo.from_layout(0, dtype, ["a"], [400])
    g = torch.Generator().manual_seed(6)
    for bad in (None, float("inf")):
        v = torch.randn(info.numel, generator=g, dtype=torch.float64).to(dtype)
        if bad is not None:
            v[7] = bad
        payload = comp.compress(v, info)
        out = torch.empty_like(v)
        assert comp.residual_into(out, v, payload)
        expected = torch.nan_to_num(v - comp.decompress(payload.tensors, payload.ctx), nan=0.0, posinf=0.0,
                                    neginf=0.0)
        assert torch.equal(out, expected)


def test_decoded_buckets_reuse_two_buffers_per_layout():
    comp = RandomKCompressor(0.1, 0)
    info = BucketInfo.from_layout(0, torch.float32, ["a"], [400])
    x = torch.randn(info.numel)
    payload = comp.compress(x, info)
    first = comp.decompress(payload.tensors, payload.ctx)
    kept, expected = first.data_ptr(), first.clone()
    second = comp.decompress(payload.tensors, payload.ctx)  # the first is held: the other buffer
    assert second.data_ptr() != kept and torch.equal(first, expected) and torch.equal(second, expected)
    del first, second
    assert comp.decompress(payload.tensors, payload.ctx).data_ptr() == kept
