"""``natural``: the sign and exponent planes (hypothesis round trip against an independent reference, special
values), unbiasedness (Monte Carlo), each on the CPU and the device path, the draws of each path, and a 4-rank
convergence smoke test."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gcomp import BucketInfo
from gcomp.compressors.natural import NaturalCompressor
from tests.compressors.quant_paths import PATHS, cpu_draws, on_path
from tests.compressors.test_terngrad import assert_converges

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


@PATHS
@PROPERTY
@given(n=st.integers(1, 300), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1), world=st.integers(1, 4))
def test_planes_round_trip_to_a_neighbouring_power_of_two(path, n, dtype, seed, world):
    with on_path(path):
        _round_trip(n, dtype, seed, world)


def _round_trip(n, dtype, seed, world):
    comps = [NaturalCompressor(seed=r) for r in range(world)]
    xs = [_wide(n, dtype, seed + r) for r in range(world)]
    payloads = [c.compress(x, BucketInfo.single(x)) for c, x in zip(comps, xs)]
    for x, p in zip(xs, payloads):
        exponents, signs = p.tensors
        assert exponents.dtype == torch.uint8 and exponents.shape == (n,)
        assert signs.dtype == torch.int64 and signs.numel() == -(-n // 64)
        assert p.nbytes == n + 8 * -(-n // 64)  # 9 bits per entry, the sign plane padded to whole words
        decoded = comps[0].decompress(p.tensors, p.ctx)
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


@PATHS
def test_special_values(path):
    with on_path(path):
        _special_values()


def _special_values():
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.0, -0.5, 2.0**-149, -(2.0**-126)])
    comp = NaturalCompressor()
    p = comp.compress(x, BucketInfo.single(x))
    out = comp.decompress(p.tensors, p.ctx)
    assert out[0].isnan()
    assert out[1] == float("inf") and out[2] == -float("inf")
    assert torch.equal(out[3:7], torch.tensor([0.0, 0.0, 1.0, -0.5]))
    assert out[7] in (0.0, 2.0**-126) and out[8] == -(2.0**-126)
    # a NaN on one rank stays non-finite in the sum with a finite rank
    other = comp.compress(torch.ones(9), BucketInfo.single(x))
    total = comp.aggregate([torch.stack([a, b]) for a, b in zip(p.tensors, other.tensors)], p.ctx)
    assert total[0].isnan() and total[1] == float("inf")


@PATHS
def test_unbiased(path):
    """Mean of 4000 draws within 6 standard errors, entry by entry: Var = (|g| - 2^e)(2^(e+1) - |g|)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, generator=g) * 10.0 ** torch.randint(-3, 4, (64,), generator=g)
    x[:3] = torch.tensor([2.0**-140, -3 * 2.0**-140, 0.75])  # subnormals round to 0 or 2^-126
    comp = NaturalCompressor(seed=3)
    trials = 4000
    total = torch.zeros(64, dtype=torch.float64)
    with on_path(path):
        for _ in range(trials):
            p = comp.compress(x, BucketInfo.single(x))
            total += comp.decompress(p.tensors, p.ctx).double()
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


def _reference_exponents(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The CPU rounding re-derived from the same stream: a random byte ``w`` per entry (``ceil(n / 64)`` int64
    words, eight bytes each), the mantissa's top byte ``t`` carries when ``t + w >= 256``; where ``t + w = 255``
    a 15-bit draw ``v`` carries when ``low 15 bits + v >= 2^15``."""
    n = x.numel()
    bits = x.view(torch.int32).long()
    words = torch.empty(-(-n // 64) * 8, dtype=torch.int64).random_(-2**63, None, generator=generator)
    w = words.view(torch.uint8)[:n].long()
    top, low, exponent = (bits >> 15) & 255, bits & (2**15 - 1), (bits >> 23) & 255
    carry = (top + w >= 256).long()
    tie = top + w == 255
    v = torch.randint(0, 2**15, (int(tie.sum()),), generator=generator, dtype=torch.int32).long()
    carry[tie] = (low[tie] + v >= 2**15).long()
    return (exponent + carry) & 255


@cpu_draws
def test_cpu_draws_take_one_random_byte_per_entry_and_refine_the_ties():
    """The exponents equal the byte-per-entry reference drawn from the compressor's own stream, and the
    stream is left where the reference leaves it (ceil(n / 64) words plus one 15-bit draw per tie)."""
    x = _wide(5000, torch.float32, 11).abs()
    comp = NaturalCompressor(seed=4)
    reference = torch.Generator().set_state(comp.random("cpu").get_state())
    p = comp.compress(x, BucketInfo.single(x))
    expected = _reference_exponents(x, reference)
    assert torch.equal(p.tensors[0].long(), expected)
    assert torch.equal(comp.random("cpu").get_state(), reference.get_state())


@PATHS
def test_the_low_mantissa_bits_round_up_through_the_ties(path):
    """1 + 2^-9 (top mantissa byte 0, low bits 2^14) rounds up with probability 2^-9 only through the 1-in-256
    ties (on the CPU path); 1 + 255/256 + (2^15 - 1) / 2^23 with probability 1 - 2^-23; 1.5 with 1/2: counts
    within 6 sigma."""
    n = 1 << 20
    for value, p in ((1 + 2.0**-9, 2.0**-9), (2 - 2.0**-23, 1 - 2.0**-23), (1.5, 0.5)):
        x = torch.full((n,), value)
        comp = NaturalCompressor(seed=2)
        with on_path(path):
            payload = comp.compress(x, BucketInfo.single(x))
        ups = int((payload.tensors[0] == 128).sum())
        assert int((payload.tensors[0] == 127).sum()) + ups == n
        assert abs(ups - n * p) <= 6 * math.sqrt(n * p * (1 - p)) + 1, (value, ups, n * p)


@PATHS
def test_nan_codes_decode_as_nan_whether_few_or_many(path):
    """NaN codes written where they are (few) or by the dense fallback (more than one word in 256 holds one); on
    the device path through the value table. A sum over ranks keeps every rank's NaN."""
    g = torch.Generator().manual_seed(1)
    for density in (0.001, 0.05, 1.0):
        x = torch.randn(40_000, generator=g)
        x[torch.rand(x.numel(), generator=g) < density] = torch.nan
        comp = NaturalCompressor()
        with on_path(path):
            p = comp.compress(x, BucketInfo.single(x))
            out = comp.decompress(p.tensors, p.ctx)
            clean = comp.compress(torch.ones_like(x), BucketInfo.single(x))
            total = comp.aggregate([torch.stack([a, b]) for a, b in zip(clean.tensors, p.tensors)], p.ctx)
        assert torch.equal(out.isnan(), x.isnan())
        assert torch.equal(total.isnan(), x.isnan())


def test_the_device_path_carries_one_23_bit_draw_per_entry_from_the_own_stream():
    """On the device path each exponent is ``(e:m + (u & (2^23 - 1))) >> 23`` for one 23-bit draw ``u`` per entry
    (two per 64-bit word of a copy of the compressor's stream, over the whole padded draws buffer), and the stream
    is left where that draw leaves it: nothing refined, nothing looked for."""
    x = _wide(5000, torch.float32, 11).abs()
    comp = NaturalCompressor(seed=4)
    reference = torch.Generator().set_state(comp.random("cpu").get_state())
    with on_path("device"):
        p = comp.compress(x, BucketInfo.single(x))
    words = torch.empty(-(-x.numel() // 64) * 32, dtype=torch.int64).random_(-2**63, None, generator=reference)
    u = words.view(torch.int32)[:x.numel()].long() & (2**23 - 1)
    expected = ((x.view(torch.int32).long() + u) >> 23) & 255
    assert torch.equal(p.tensors[0].long(), expected)
    assert torch.equal(comp.random("cpu").get_state(), reference.get_state())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_device_decode_is_the_cpu_decode(dtype):
    """The value table gives exactly the CPU path's bfloat16-built values, NaN codes and infinities included, for
    one payload and for a sum over ranks."""
    x = _wide(3000, dtype, 3)
    x[::97] = torch.nan
    comp = NaturalCompressor(seed=1)
    payloads = [comp.compress(x * (r + 1), BucketInfo.single(x)) for r in range(3)]
    stacked = [torch.stack([p.tensors[j] for p in payloads]) for j in range(2)]
    cpu = [comp.decompress(payloads[0].tensors, payloads[0].ctx), comp.aggregate(stacked, payloads[0].ctx).clone()]
    with on_path("device"):
        device = [comp.decompress(payloads[0].tensors, payloads[0].ctx), comp.aggregate(stacked, payloads[0].ctx)]
    for a, b in zip(cpu, device):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
