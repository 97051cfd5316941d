"""``natural``: the sign and exponent planes (hypothesis round trip against an independent reference, special
values), unbiasedness (Monte Carlo), the carry drawn from the own stream, NaN codes, and a 4-rank convergence smoke
test."""
from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gcomp import BucketInfo
from gcomp.compressors.quantise import NaturalCompressor
from tests.compressors.test_terngrad import assert_converges, decode_all, decode_alone, encode, first_draw

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
PROPERTY = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SMALLEST_NORMAL = 2.0**-126


def _wide(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Magnitudes over the dtype's whole range (fp32's for fp64), subnormals, zeros of both signs, powers of two."""
    g = torch.Generator().manual_seed(seed)
    info = torch.finfo(dtype if dtype != torch.float64 else torch.float32)
    low, high = torch.log2(torch.tensor(info.smallest_normal * info.eps)), torch.log2(torch.tensor(info.max))
    exps = torch.rand(n, generator=g, dtype=torch.float64) * float(high - low - 1) + float(low)
    x = torch.exp2(exps) * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    pick = torch.rand(n, generator=g)
    x[pick < 0.05] = 0.0
    x[(pick >= 0.05) & (pick < 0.1)] = -0.0
    x[(pick >= 0.1) & (pick < 0.2)] = torch.exp2(exps[(pick >= 0.1) & (pick < 0.2)].round())
    return x.to(dtype)


@PROPERTY
@given(n=st.integers(1, 300), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1), world=st.integers(1, 4))
def test_planes_round_trip_to_a_neighbouring_power_of_two(n, dtype, seed, world):
    comps = [NaturalCompressor(seed=r) for r in range(world)]
    xs = [_wide(n, dtype, seed + r) for r in range(world)]
    payloads = [encode(c, x, BucketInfo.single(x)) for c, x in zip(comps, xs)]
    for x, p in zip(xs, payloads):
        exponents, signs = p.tensors
        assert exponents.dtype == torch.uint8 and exponents.shape == (n,)
        assert signs.dtype == torch.int64 and signs.numel() == -(-n // 64)
        assert p.nbytes == n + 8 * -(-n // 64)  # 9 bits per entry, the sign plane padded to whole words
        assert p.nbytes == comps[0].traits.wire_bytes(BucketInfo.single(x), world)
        decoded = decode_alone(comps[0], p)
        assert decoded.dtype == dtype and decoded.shape == x.shape
        x32 = x.to(torch.float32).double()  # what was rounded: the fp32 value (fp64 buckets round to it first)
        d = decoded.to(torch.float32).double() if dtype != torch.float64 else decoded
        mantissa, exponent = torch.frexp(x32.abs())
        low = torch.where(x32.abs() < SMALLEST_NORMAL, 0.0, torch.ldexp(torch.ones_like(x32), exponent - 1))
        high = torch.where(x32.abs() < SMALLEST_NORMAL, SMALLEST_NORMAL, 2 * low)
        exact = ((mantissa == 0.5) & (x32.abs() >= SMALLEST_NORMAL)) | (x32 == 0)  # normal powers of two, zeros: kept
        up_or_down = (d.abs() == low) | (d.abs() == high)
        in_range = high <= torch.finfo(dtype).max if dtype != torch.float64 else torch.ones_like(up_or_down)
        ok = torch.where(exact, d.abs() == x32.abs(), up_or_down)
        assert ok[in_range].all()
        assert ((d == 0) | (d.sign() == x32.sign())).all()
        assert (d[x32 == 0] == 0).all() and not d.signbit()[x32 == 0].any()  # -0 is sent as +0
    total, parts = decode_all(comps[0], payloads), [decode_alone(comps[0], p) for p in payloads]
    work = torch.promote_types(dtype, torch.float32)
    expected = torch.stack([part.to(work) for part in parts]).sum(0).to(dtype)
    assert torch.equal(total.isnan(), expected.isnan()) and torch.equal(total.nan_to_num(), expected.nan_to_num())


def test_special_values():
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.0, -0.5, 2.0**-149, -(2.0**-126)])
    comp = NaturalCompressor()
    p = encode(comp, x, BucketInfo.single(x))
    out = decode_alone(comp, p)
    assert out[0].isnan()
    assert out[1] == float("inf") and out[2] == -float("inf")
    assert torch.equal(out[3:7], torch.tensor([0.0, 0.0, 1.0, -0.5]))
    assert out[7] in (0.0, 2.0**-126) and out[8] == -(2.0**-126)
    # a NaN on one rank stays non-finite in the sum with a finite rank
    total = decode_all(comp, [p, encode(comp, torch.ones(9), BucketInfo.single(x))])
    assert total[0].isnan() and total[1] == float("inf")


def test_unbiased():
    """Mean of 4000 draws within 6 standard errors, entry by entry: Var = (|g| - 2^e)(2^(e+1) - |g|)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, generator=g) * 10.0 ** torch.randint(-3, 4, (64,), generator=g)
    x[:3] = torch.tensor([2.0**-140, -3 * 2.0**-140, 0.75])  # subnormals round to 0 or 2^-126
    comp = NaturalCompressor(seed=3)
    trials = 4000
    total = torch.zeros(64, dtype=torch.float64)
    for _ in range(trials):
        total += decode_alone(comp, encode(comp, x, BucketInfo.single(x))).double()
    a = x.double().abs()
    mantissa, exponent = torch.frexp(a)
    low = torch.where(a < SMALLEST_NORMAL, 0.0, torch.ldexp(torch.ones_like(a), exponent - 1))
    high = torch.where(a < SMALLEST_NORMAL, SMALLEST_NORMAL, 2 * low)
    var = (a - low) * (high - a)
    bound = 6 * (var / trials).sqrt() + 1e-9 * a
    assert ((total / trials - x.double()).abs() <= bound).all()


def test_natural_lowers_the_loss_on_four_ranks():
    # Dense DDP ends at about 0.36 of its initial loss (bound 0.45). Natural compression's relative variance is
    # at most 1/8 per entry; it measured 0.36 too, so the same bound as dense.
    assert_converges([(None, {}), ("natural", {})], [0.45, 0.45])


def test_low_mantissa_bits_round_up_with_their_probability():
    """1 + 2^-9 rounds up with probability 2^-9, 1 + 255/256 + (2^15 - 1) / 2^23 with 1 - 2^-23, 1.5 with 1/2: counts
    within 6 sigma."""
    n = 1 << 20
    for value, p in ((1 + 2.0**-9, 2.0**-9), (2 - 2.0**-23, 1 - 2.0**-23), (1.5, 0.5)):
        x = torch.full((n,), value)
        payload = encode(NaturalCompressor(seed=2), x, BucketInfo.single(x))
        ups = int((payload.tensors[0] == 128).sum())
        assert int((payload.tensors[0] == 127).sum()) + ups == n
        assert abs(ups - n * p) <= 6 * math.sqrt(n * p * (1 - p)) + 1, (value, ups, n * p)


def test_nan_codes_decode_as_nan_whether_few_or_many():
    """NaN codes decode as NaN at any density; a sum over ranks keeps every rank's NaN."""
    g = torch.Generator().manual_seed(1)
    for density in (0.001, 0.05, 1.0):
        x = torch.randn(40_000, generator=g)
        x[torch.rand(x.numel(), generator=g) < density] = torch.nan
        comp = NaturalCompressor()
        p = encode(comp, x, BucketInfo.single(x))
        out = decode_alone(comp, p)
        total = decode_all(comp, [encode(comp, torch.ones_like(x), BucketInfo.single(x)), p])
        assert torch.equal(out.isnan(), x.isnan())
        assert torch.equal(total.isnan(), x.isnan())


def test_the_carry_is_one_23_bit_draw_per_entry_from_the_own_stream():
    """Each exponent is ``(e:m + u) >> 23`` for one draw ``u`` uniform on [0, 2^23) per entry, from the stream's first
    draw; the stream has made one draw."""
    x = _wide(5000, torch.float32, 11).abs()
    comp = NaturalCompressor(seed=4)
    p = encode(comp, x, BucketInfo.single(x))
    u = torch.randint(0, 2**23, (x.numel(),), generator=first_draw(4, "natural"), dtype=torch.int32).long()
    expected = ((x.view(torch.int32).long() + u) >> 23) & 255
    assert torch.equal(p.tensors[0].long(), expected)
    assert comp.stream.draws == 1
