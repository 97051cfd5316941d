"""``qsgd``: the level fields (hypothesis round trip, every width), unbiasedness (Monte Carlo), non-finite norms, the
draws from the own stream, and a 4-rank convergence smoke test."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import gcomp
from gcomp.collectives import bitpack
from gcomp.compressors.quantise import QSGDCompressor, field_bits
from tests.compressors.test_terngrad import (assert_converges, decode_all, decode_alone, encode, first_draw, gradient,
                                             layout, segment_views)

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
PROPERTY = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_field_bits_is_sign_plus_level_bits():
    for s in [1, 2, 3, 4, 7, 8, 127, 128, 255, 256, 1000, 2**15 - 1]:
        assert field_bits(s) == s.bit_length() + 1  # ceil(log2(s + 1)) level bits, one sign bit
        assert 2 ** field_bits(s) > 2 * s  # every l + s in [0, 2s] fits
    assert field_bits(127) == 8 and field_bits(1) == 2 and field_bits(255) == 9


@PROPERTY
@given(sizes=st.lists(st.integers(0, 200), min_size=1, max_size=4).filter(lambda s: sum(s) > 0),
       levels=st.one_of(st.sampled_from([1, 2, 7, 127, 128, 255, 2**15 - 1]), st.integers(1, 2**15 - 1)),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1), zeros=st.sampled_from([0.0, 0.3, 1.0]),
       world=st.integers(1, 4))
@example(sizes=[8], levels=1, dtype=torch.float32, seed=0, zeros=0.0, world=1)  # 8 entries: one word's bytes
def test_levels_round_trip_and_the_gathered_decode_is_the_sum_of_decodes(sizes, levels, dtype, seed, zeros, world):
    info = layout(sizes, dtype)
    comps = [QSGDCompressor(levels, seed=r) for r in range(world)]
    xs = [gradient(sizes, dtype, seed + r, zeros) for r in range(world)]
    payloads = [encode(c, x, info) for c, x in zip(comps, xs)]
    n, bits = sum(sizes), field_bits(levels)
    for x, p in zip(xs, payloads):
        norms, words = p.tensors
        assert norms.dtype == torch.float32 and norms.shape == (len(sizes),)
        assert p.nbytes == 4 * len(sizes) + 8 * bitpack.packed_words(n, bits)
        fields = bitpack.unpack(words, n, bits)
        assert int(fields.min()) >= 0 and int(fields.max()) <= 2 * levels
        decoded = decode_alone(comps[0], p)
        assert decoded.shape == x.shape and decoded.dtype == dtype
        for j, (xj, fj, dj) in enumerate(zip(segment_views(x, sizes), segment_views(fields, sizes),
                                             segment_views(decoded, sizes))):
            if not xj.numel():
                continue
            r = norms[j].double()
            assert r >= torch.linalg.vector_norm(xj.double()) * (1 - 1e-6)
            signed = fj - levels
            assert ((signed == 0) | (signed.sign() == xj.double().sign().long())).all()
            # the level is the exact one rounded down or up: |l - s |g| / r| < 1
            exact = (xj.double().abs() / r * levels).nan_to_num(nan=0.0)  # a zero parameter: 0 / 0
            assert ((signed.abs().double() - exact).abs() < 1 + 1e-5).all()
            unit = (norms[j:j + 1].to(torch.promote_types(dtype, torch.float32)) / levels)
            assert torch.equal(dj, (signed.to(unit.dtype) * unit).to(dtype))
    total = decode_all(comps[0], payloads)
    parts = torch.stack([decode_alone(comps[0], p).double() for p in payloads])
    eps = torch.finfo(dtype).eps
    assert ((total.double() - parts.sum(0)).abs() <= (world + 1) * eps * parts.abs().sum(0)).all()
    assert comps[0].traits.wire_bytes(info, world) == payloads[0].nbytes


@pytest.mark.parametrize("levels", [1, 4, 127])
def test_unbiased(levels):
    """Mean of 3000 draws within 6 standard errors of g, entry by entry: Var = (r / s)^2 p (1 - p), p the
    fractional part of s |g| / r."""
    sizes = [40, 9, 1]
    info = layout(sizes, torch.float32)
    x = gradient(sizes, torch.float32, seed=4)
    comp = QSGDCompressor(levels, seed=2)
    trials = 3000
    total = torch.zeros(x.numel(), dtype=torch.float64)
    for _ in range(trials):
        total += decode_alone(comp, encode(comp, x, info)).double()
    r = torch.cat([torch.full((n,), float(torch.linalg.vector_norm(v)))
                   for n, v in zip(sizes, segment_views(x, sizes))])
    g = x.double()
    frac = (g.abs() / r.double() * levels).frac()
    var = (r.double() / levels) ** 2 * frac * (1 - frac)
    bound = 6 * (var / trials).sqrt() + 1e-6 * r.double()
    assert ((total / trials - g).abs() <= bound).all()


@pytest.mark.parametrize("levels", [127, 3])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_entry_makes_its_parameter_nonfinite(levels, bad):
    sizes = [10, 6]
    x = gradient(sizes, torch.float32, seed=0)
    x[2] = bad
    comp = QSGDCompressor(levels)
    info = layout(sizes, torch.float32)
    out = decode_all(comp, [encode(comp, x, info), encode(comp, torch.ones(16), info)])
    assert not out[:10].isfinite().any()
    assert out[10:].isfinite().all()


def test_default_is_one_byte_per_entry():
    method = gcomp.create("qsgd")
    x = torch.randn(1000)
    assert encode(method.compressor, x, gcomp.BucketInfo.single(x)).nbytes == 1000 + 4  # 8-bit fields, one norm


@pytest.mark.parametrize("levels", [127, 3])
def test_the_levels_are_rounded_against_one_uniform_per_entry_from_the_own_stream(levels):
    """Every field is ``floor(s g / r + u) + s`` for the norms sent and one uniform ``u`` per entry of the stream's
    first draw; the stream has made one draw."""
    sizes = [300, 0, 41, 1]
    info, x = layout(sizes, torch.float32), gradient(sizes, torch.float32, seed=5, zeros=0.2)
    comp = QSGDCompressor(levels, seed=3)
    norms, words = encode(comp, x, info).tensors
    exact = torch.cat([torch.full((n,), float(r)) for n, r in zip(sizes, norms)])
    torch.testing.assert_close(exact[:300], torch.full((300,), float(torch.linalg.vector_norm(x[:300]))))
    factors = torch.where(exact > 0, levels / exact, 0.0)
    u = torch.rand(x.numel(), generator=first_draw(3, "qsgd"))
    expected = (u + x * factors).floor_().clamp_(-levels, levels) + levels
    assert torch.equal(bitpack.unpack(words, x.numel(), field_bits(levels)), expected.long())
    assert comp.stream.draws == 1


def test_qsgd_lowers_the_loss_on_four_ranks():
    # Dense DDP ends at about 0.36 of its initial loss (bound 0.45). With s = 127 levels QSGD matched it (0.36),
    # so the same bound; s = 2 (3 bits per entry) measured 0.37 and s = 1 0.40: noisier, bound 0.5.
    assert_converges([(None, {}), ("qsgd", {}), ("qsgd", {"levels": 2}), ("qsgd", {"levels": 1})],
                     [0.45, 0.45, 0.5, 0.5])
