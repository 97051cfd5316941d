"""``onebit``: the two-means codec per parameter (hypothesis, parameters of any size, empty ones and bytes of sign
bits shared by several included), zeros going with the non-negatives and NaN with the negatives, non-finite values
surfacing, aggregation as the sum of decodes, layout-free means, error-feedback conservation, and a 4-rank
convergence smoke test (the 1-bit packer, the sum of ranks in groups and the operation counts are tested in
test_sign.py: onebit shares them)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gcomp import BucketInfo
from gcomp.compressors.sign.onebit import OneBitCompressor
from gcomp.compressors.sign.wire import ROW
from tests.compressors.test_sign import alone, check_conservation, check_convergence, gathered

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _layout(numels, dtype) -> BucketInfo:
    return BucketInfo.from_layout(0, dtype, [f"p{i}" for i in range(len(numels))], numels)


def _values(n: int, dtype: torch.dtype, seed: int, zeros: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64) * 10 ** torch.empty(n, dtype=torch.float64).uniform_(
        -2, 2, generator=g)
    x[torch.rand(n, generator=g) < zeros] = 0.0
    return x.to(dtype)


NUMELS = st.lists(st.sampled_from([0, 1, 3, 8]) | st.integers(1, 300), min_size=1, max_size=6).filter(
    lambda k: sum(k) > 0)


@PROPERTY
@given(numels=NUMELS, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1),
       zeros=st.sampled_from([0.0, 0.3, 1.0]), sign=st.sampled_from([0, 1, -1]))
def test_each_entry_decodes_to_the_mean_of_its_side_in_its_parameter(numels, dtype, seed, zeros, sign):
    n = sum(numels)
    x = _values(n, dtype, seed, zeros)
    if sign:  # all one side: the other side's mean is 0 and unused
        x = x.abs() * sign
    info = _layout(numels, dtype)
    payload, _ = OneBitCompressor().encode(x, {}, info)
    words, means = payload.tensors
    assert words.dtype == torch.int64 and words.shape == (-(-n // 64),)
    assert means.dtype == torch.float32 and means.shape == (2 * len(numels),)
    assert payload.nbytes == 8 * -(-n // 64) + 8 * len(numels) == OneBitCompressor.traits.wire_bytes(info, 2)
    out = alone(OneBitCompressor(), x, info)
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
@given(numels=NUMELS, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1), world=st.integers(1, 8))
def test_aggregate_is_the_sum_of_decodes(numels, dtype, seed, world):
    info, comp = _layout(numels, dtype), OneBitCompressor()
    xs = [_values(info.numel, dtype, seed + r, 0.1) for r in range(world)]
    out = comp.decode(*gathered(comp, xs, info))
    assert out.shape == (info.numel,) and out.dtype == dtype
    decoded = torch.stack([alone(comp, x, info).double() for x in xs])
    eps = max(torch.finfo(dtype).eps, torch.finfo(torch.float32).eps)
    bound = (world + 1) * eps * decoded.abs().sum(0) + 1e-30
    assert ((out.double() - decoded.sum(0)).abs() <= bound).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_entry_decodes_non_finite_after_aggregation(bad):
    info, comp = _layout([30, 20], torch.float32), OneBitCompressor()
    xs = [_values(50, torch.float32, r, 0.1) for r in range(3)]
    xs[2][35] = bad
    out = comp.decode(*gathered(comp, xs, info))
    assert not out[35].isfinite()
    if bad != bad:  # NaN is sent with the negatives (bit 0): its side of that parameter decodes to NaN
        assert out[30:][xs[2][30:] < 0].isnan().all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_error_feedback_conservation(dtype):
    check_conservation("onebit", [200, 7, 57], dtype, 3)


# Eval loss after 60 steps as a fraction of its start, 4 ranks (see test_sign.py): dense 0.37, onebit 0.39.
# Bound 0.5, as for efsignsgd: error feedback returns what the two means leave out, so it tracks dense SGD.
def test_four_ranks_lower_the_loss():
    check_convergence("onebit", {}, 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_means_are_bit_for_bit_the_same_whatever_the_layout(dtype):
    """Each side of a parameter is summed in rows from the parameter's own start: its two means do not move by
    one bit with the order of the parameters, their offsets in the bucket, or the thread count."""
    numels = {"w": 16 * ROW + 2 * ROW + 3, "b": 13, "v": 3 * ROW + 1, "u": 1, "e": 0}
    parts = {name: _values(k, dtype, i, 0.2) for i, (name, k) in enumerate(numels.items())}

    def means(order, threads):
        info = BucketInfo.from_layout(0, dtype, order, [numels[n] for n in order])
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            payload, _ = OneBitCompressor().encode(torch.cat([parts[n] for n in order]), {}, info)
        finally:
            torch.set_num_threads(before)
        m = payload.tensors[1].view(2, -1)
        return {n: m[:, i] for i, n in enumerate(order)}

    reference = means(list(numels), 1)
    for order, threads in [(["u", "e", "v", "b", "w"], 1), (["b", "w", "u", "v", "e"], 2)]:
        got = means(order, threads)
        assert all(torch.equal(got[n], reference[n]) for n in numels), (order, threads)
    w = parts["w"].double()  # a parameter over many rows: still the means of its two sides
    torch.testing.assert_close(reference["w"].double(), torch.stack([w[w < 0].mean(), w[w >= 0].mean()]),
                               rtol=1e-6, atol=0)
    assert reference["e"].tolist() == [0.0, 0.0]  # an empty parameter: both sides empty
