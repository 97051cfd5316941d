"""``onebit``: the two-means codec per parameter (hypothesis), zeros going with the non-negatives and NaN with the
negatives, non-finite values surfacing, aggregation as the sum of decodes, error-feedback conservation, and a
4-rank convergence smoke test (the 1-bit packer itself is tested in test_sign.py: onebit shares it). On both
paths, as test_sign.py (its ``path`` fixture); the CPU path's kept buffers on that path only."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gcomp
from gcomp import BucketInfo
from gcomp.compressors.onebit import OneBitCompressor
from gcomp.compressors.sign import BLOCK, ROW
from tests.compressors.test_sign import check_convergence, cpu_path_only, path  # noqa: F401 (a fixture)

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
PROPERTY = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def _layout(numels, dtype) -> BucketInfo:
    return BucketInfo.from_layout(0, dtype, [f"p{i}" for i in range(len(numels))], numels)


def _values(n: int, dtype: torch.dtype, seed: int, zeros: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64) * 10 ** torch.empty(n, dtype=torch.float64).uniform_(
        -2, 2, generator=g)
    x[torch.rand(n, generator=g) < zeros] = 0.0
    return x.to(dtype)


@PROPERTY
@given(numels=st.lists(st.integers(1, 300), min_size=1, max_size=5), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**31 - 1), zeros=st.sampled_from([0.0, 0.3, 1.0]), sign=st.sampled_from([0, 1, -1]))
def test_each_entry_decodes_to_the_mean_of_its_side_in_its_parameter(numels, dtype, seed, zeros, sign, path):
    n = sum(numels)
    x = _values(n, dtype, seed, zeros)
    if sign:  # all one side: the other side's mean is 0 and unused
        x = x.abs() * sign
    info = _layout(numels, dtype)
    comp = OneBitCompressor()
    payload = comp.compress(x, info)
    words, means = payload.tensors
    assert words.dtype == torch.int64 and words.shape == (-(-n // 64),)
    assert means.dtype == torch.float32 and means.shape == (2 * len(numels),)
    assert payload.nbytes == 8 * -(-n // 64) + 8 * len(numels)
    out = comp.decompress(payload.tensors, payload.ctx)
    assert out.shape == x.shape and out.dtype == dtype
    for i, (_, offset, k) in enumerate(info.segments()):
        seg = x[offset:offset + k].double()
        plus = seg >= 0  # zeros go with the non-negatives
        neg_mean = seg[~plus].mean() if (~plus).any() else torch.tensor(0.0, dtype=torch.float64)
        pos_mean = seg[plus].mean() if plus.any() else torch.tensor(0.0, dtype=torch.float64)
        torch.testing.assert_close(means[i].double(), neg_mean, rtol=1e-5, atol=0)
        torch.testing.assert_close(means[len(numels) + i].double(), pos_mean, rtol=1e-5, atol=0)
        expected = torch.where(plus, means[len(numels) + i], means[i]).to(dtype)
        assert torch.equal(out[offset:offset + k], expected)
    # 1-bit SGD keeps each parameter's sum: the decode has the same total as the input, per parameter
    # (up to the rounding of each decoded entry to the bucket's dtype and of the fp32 means)
    eps = torch.finfo(dtype).eps + torch.finfo(torch.float32).eps
    for _, offset, k in info.segments():
        seg_out, seg_x = out[offset:offset + k].double(), x[offset:offset + k].double()
        assert (seg_out.sum() - seg_x.sum()).abs() <= 2 * eps * (seg_out.abs().sum() + seg_x.abs().sum()) + 1e-300


@PROPERTY
@given(numels=st.lists(st.integers(1, 200), min_size=1, max_size=4), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**31 - 1), world=st.integers(1, 8))
def test_aggregate_is_the_sum_of_decompressions(numels, dtype, seed, world, path):
    info = _layout(numels, dtype)
    comp = OneBitCompressor()
    payloads = [comp.compress(_values(info.numel, dtype, seed + r, 0.1), info) for r in range(world)]
    gathered = [torch.stack([p.tensors[j] for p in payloads]) for j in range(2)]
    out = comp.aggregate(gathered, payloads[0].ctx)
    assert out.shape == (info.numel,) and out.dtype == dtype
    decoded = torch.stack([comp.decompress(p.tensors, p.ctx).double() for p in payloads])
    eps = max(torch.finfo(dtype).eps, torch.finfo(torch.float32).eps)
    bound = (world + 1) * eps * decoded.abs().sum(0) + 1e-30
    assert ((out.double() - decoded.sum(0)).abs() <= bound).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_entry_decodes_non_finite_after_aggregation(bad, path):
    info = _layout([30, 20], torch.float32)
    comp = OneBitCompressor()
    xs = [_values(50, torch.float32, r, 0.1) for r in range(3)]
    xs[2][35] = bad
    payloads = [comp.compress(x, info) for x in xs]
    out = comp.aggregate([torch.stack([p.tensors[j] for p in payloads]) for j in range(2)], payloads[0].ctx)
    assert not out[35].isfinite()
    if bad != bad:  # NaN is sent with the negatives (bit 0): its side of that parameter decodes to NaN
        assert out[30:][xs[2][30:] < 0].isnan().all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_error_feedback_conservation(dtype, path):
    method = gcomp.create("onebit")
    comp, memory = method.compressor, method.memory
    info = _layout([200, 7, 57], dtype)
    g = torch.Generator().manual_seed(3)
    residual = torch.zeros(info.numel, dtype=dtype)
    for step in range(6):
        grad = (torch.randn(info.numel, generator=g, dtype=torch.float64) * (step + 1)).to(dtype)
        compensated = memory.compensate(grad, info)
        assert torch.equal(compensated, grad + residual)
        payload = comp.compress(compensated, info)
        memory.update(compensated, info, comp, payload)
        sent = comp.decompress(payload.tensors, payload.ctx)
        new = memory.compensate(torch.zeros_like(grad), info)  # the stored residual (compensate only reads)
        err = (sent.double() + new.double() - compensated.double()).abs()
        assert (err <= torch.finfo(dtype).eps * new.double().abs()).all(), f"step {step}"
        assert new.count_nonzero() > 0
        residual = new


# Eval loss after 60 steps as a fraction of its start, 4 ranks (see test_sign.py): dense 0.37, onebit 0.39.
# Bound 0.5, as for efsignsgd: error feedback returns what the two means leave out, so it tracks dense SGD.
@pytest.mark.parametrize("device", [False, True], ids=["cpu-path", "device-path"])
def test_four_ranks_lower_the_loss(device):
    check_convergence("onebit", {}, 0.5, device=device)


# --- layout independence, large parameters, buffers kept across steps ---------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_means_are_bit_for_bit_the_same_whatever_the_layout(dtype, path):
    """Each side of a parameter is summed in rows from the parameter's own start: its two means do not move by
    one bit with the order of the parameters, their offsets in the bucket, or the thread count."""
    numels = {"w": BLOCK + 2 * ROW + 3, "b": 13, "v": 3 * ROW + 1, "u": 1}
    parts = {name: _values(k, dtype, i, 0.2) for i, (name, k) in enumerate(numels.items())}

    def means(order, threads):
        info = BucketInfo.from_layout(0, dtype, order, [numels[n] for n in order])
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            payload = OneBitCompressor().compress(torch.cat([parts[n] for n in order]), info)
        finally:
            torch.set_num_threads(before)
        m = payload.tensors[1].view(2, -1)
        return {n: m[:, i] for i, n in enumerate(order)}, payload

    reference, payload = means(list(numels), 1)
    for order, threads in [(["u", "v", "b", "w"], 1), (["b", "w", "u", "v"], 2)]:
        got, _ = means(order, threads)
        assert all(torch.equal(got[n], reference[n]) for n in numels), (order, threads)
    w = parts["w"].double()  # a parameter over several blocks: still the means of its two sides
    torch.testing.assert_close(reference["w"].double(), torch.stack([w[w < 0].mean(), w[w >= 0].mean()]),
                               rtol=1e-6, atol=0)


@cpu_path_only  # the device path leaves its buffers to the device's caching allocator
def test_decoded_buckets_reuse_buffers_kept_across_steps_but_never_one_still_held():
    info = _layout([300, 5, 200], torch.float32)
    comp = OneBitCompressor()
    payloads = [comp.compress(_values(505, torch.float32, s, 0.1), info) for s in range(3)]
    first = comp.decompress(payloads[0].tensors, payloads[0].ctx)
    held = first.clone()
    second = comp.decompress(payloads[1].tensors, payloads[1].ctx)
    assert second.data_ptr() != first.data_ptr() and torch.equal(first, held)
    ptr = second.data_ptr()
    del second
    third = comp.aggregate([t.unsqueeze(0) for t in payloads[2].tensors], payloads[2].ctx)
    assert third.data_ptr() == ptr  # the dropped one's buffer, not a fresh bucket
    assert torch.equal(first, held) and torch.equal(third, comp.decompress(payloads[2].tensors, payloads[2].ctx))
