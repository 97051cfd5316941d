"""``gcomp.compressors.blockfloat.minifloat`` against the formats' definitions (``minifloat_reference``): the spec's
values, every code, every tie, any fp32 (hypothesis), saturation, NaN, stochastic rounding, torch's float8 casts."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gcomp.compressors.blockfloat import minifloat
from tests.compressors.minifloat_reference import REFERENCES, fp32

NAMES = sorted(REFERENCES)
NAN = float("nan")


def _codes(values, name, **kwargs) -> list[int]:
    return minifloat.encode(torch.tensor(values, dtype=torch.float32), name, **kwargs).tolist()


@pytest.mark.parametrize("name, max_normal, min_normal, min_subnormal, emax", [
    ("e4m3", 448.0, 2.0 ** -6, 2.0 ** -9, 8),
    ("e5m2", 57344.0, 2.0 ** -14, 2.0 ** -16, 15),
    ("e3m2", 28.0, 0.25, 0.0625, 4),
    ("e2m3", 7.5, 1.0, 0.125, 2),
    ("e2m1", 6.0, 1.0, 0.5, 2),
])
def test_the_specs_values(name, max_normal, min_normal, min_subnormal, emax):
    fmt, reference = minifloat.minifloat(name), REFERENCES[name]
    assert (fmt.max, fmt.min_normal, fmt.min_subnormal, fmt.emax) == (max_normal, min_normal, min_subnormal, emax)
    assert float(reference.max) == max_normal and float(reference.magnitudes[1]) == min_subnormal
    assert float(reference.magnitudes[1 << reference.mbits]) == min_normal


def test_e2m1_holds_exactly_the_eight_magnitudes():
    values = minifloat.table("e2m1").tolist()
    assert values[:8] == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert values[8:] == [-0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert math.copysign(1, values[8]) < 0


@pytest.mark.parametrize("name", NAMES)
def test_every_code_decodes_to_its_definition(name):
    reference = REFERENCES[name]
    decoded = minifloat.decode(torch.arange(1 << reference.bits, dtype=torch.uint8), name).tolist()
    expected = [reference.value(code) for code in range(1 << reference.bits)]
    for code, (got, want) in enumerate(zip(decoded, expected)):
        assert (math.isnan(got) and math.isnan(want)) or (got == want and math.copysign(1, got) == math.copysign(
            1, want)), f"{name} code {code:#x}: {got} != {want}"


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_every_representable_value_round_trips(name, rounding):
    codes = torch.arange(1 << REFERENCES[name].bits, dtype=torch.uint8)
    values = minifloat.decode(codes, name)
    numbers = ~values.isnan() & ~values.isinf()
    again = minifloat.encode(values[numbers], name, rounding=rounding, generator=torch.Generator().manual_seed(1))
    assert torch.equal(again, codes[numbers])


@pytest.mark.parametrize("name", NAMES)
def test_every_tie_and_its_fp32_neighbours_round_as_the_definition(name):
    reference = REFERENCES[name]
    values = reference.midpoints()
    values = values + [-v for v in values]
    assert _codes(values, name) == [reference.encode(v) for v in values]


@pytest.mark.parametrize("name", NAMES)
def test_saturation_and_specials(name):
    reference, fmt = REFERENCES[name], minifloat.minifloat(name)
    top, sign = reference.max_code, reference.sign_bit
    big = [fmt.max * 1.0001, 1e30, 3.4e38, math.inf, -math.inf, -1e30]
    assert _codes(big, name) == [top, top, top, top, top | sign, top | sign]
    nan_codes = _codes([NAN, -NAN], name)
    if reference.nan_code is None:
        assert nan_codes == [top, top | sign]  # no NaN in the format: the block's scale carries it
    else:
        assert nan_codes == [0x7F, 0xFF]
        assert all(math.isnan(v) for v in minifloat.decode(torch.tensor(nan_codes, dtype=torch.uint8), name))
    assert _codes([0.0, -0.0, 1e-45, -1e-45], name) == [0, sign, 0, sign]


FP32 = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)
SCALED = st.builds(lambda f, e: fp32(f * 2.0 ** e), st.floats(-2, 2, width=32), st.integers(-20, 17))


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.one_of(FP32, SCALED), min_size=1, max_size=40), name=st.sampled_from(NAMES))
def test_any_fp32_encodes_as_the_definition(values, name):
    reference = REFERENCES[name]
    assert _codes(values, name) == [reference.encode(v) for v in values]


@pytest.mark.parametrize("name, dtype", [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)])
def test_torchs_float8_casts_agree_in_range(name, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20000, generator=g) * torch.randn(20000, generator=g).exp2().mul(4).exp2()
    x = x.clamp(-minifloat.minifloat(name).max, minifloat.minifloat(name).max)
    assert torch.equal(minifloat.encode(x, name), x.to(dtype).view(torch.uint8))
    codes = torch.arange(256, dtype=torch.uint8)
    ours, theirs = minifloat.decode(codes, name), codes.view(dtype).float()
    assert torch.equal(ours.isnan(), theirs.isnan())
    assert torch.equal(ours[~ours.isnan()], theirs[~theirs.isnan()])


@pytest.mark.parametrize("name, x", [("e2m1", 1.3), ("e2m1", -0.3), ("e4m3", 2.0 ** -8 * 1.7),
                                     ("e4m3", 300.0), ("e3m2", 0.1), ("e2m3", 5.3), ("e5m2", 3e-5)])
def test_stochastic_rounding_is_unbiased_and_picks_a_neighbour(name, x):
    """30,000 draws of one value: the mean's standard error is at most half a step over sqrt(30,000)
    (``step * sqrt(p (1 - p) / n)``), so a bias under 5 standard errors passes by chance with probability < 1e-6
    and a fixed seed makes it repeatable; each draw is one of the two neighbours."""
    n = 30_000
    x = fp32(x)
    low, high = REFERENCES[name].neighbours(x)
    codes = minifloat.encode(torch.full((n,), x), name, rounding="stochastic",
                             generator=torch.Generator().manual_seed(7))
    drawn = minifloat.decode(codes, name).double()
    assert set(drawn.unique().tolist()) <= {low, high}
    assert low != high
    p = (x - low) / (high - low)
    bound = 5 * (high - low) * math.sqrt(p * (1 - p) / n)
    assert abs(drawn.mean().item() - x) < bound
    # both neighbours drawn, in proportion: a rounding that is not stochastic fails
    assert 0 < (drawn == high).double().mean().item() < 1


@settings(max_examples=30, deadline=None)
@given(values=st.lists(st.floats(-1e6, 1e6, width=32), min_size=1, max_size=40), name=st.sampled_from(NAMES),
       seed=st.integers(0, 2 ** 31))
def test_stochastic_rounding_always_gives_one_of_the_two_neighbours(values, name, seed):
    reference = REFERENCES[name]
    codes = minifloat.encode(torch.tensor(values), name, rounding="stochastic",
                             generator=torch.Generator().manual_seed(seed))
    for v, got in zip(values, minifloat.decode(codes, name).tolist()):
        assert got in reference.neighbours(v), f"{v} -> {got}"


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="did you mean e2m1"):
        minifloat.minifloat("e2m1x")
    with pytest.raises(ValueError, match="rounding"):
        minifloat.encode(torch.ones(4), "e4m3", rounding="up")
    with pytest.raises(ValueError, match="fp32"):
        minifloat.encode(torch.ones(4, dtype=torch.float64), "e4m3")
