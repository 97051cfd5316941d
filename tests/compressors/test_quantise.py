"""``gcomp.compressors.quantise``: random streams that cannot replay a user's small seeds, per-rank and shared;
per-segment scales by TernGrad's clipping rule."""
from __future__ import annotations

import math

import pytest
import torch

from gcomp.compressors.quantise import RankGenerator, add_scaled_, draw_units, segment_scales, stream_seed

TAGS = ("terngrad", "qsgd", "natural", "pactrain", "dgc", "randomk", "powersgd")


def test_streams_are_distinct_and_far_from_small_seeds():
    """Every (seed, tag, rank) of a realistic range gets its own seed, none of them a small integer a user's
    ``torch.Generator().manual_seed(n)`` would take (the old ``seed * 1_000_003 + rank`` gave rank r of seed 0
    the seed r)."""
    seeds = {stream_seed(seed, tag, rank) for seed in range(20) for tag in TAGS for rank in [None, *range(8)]}
    assert len(seeds) == 20 * len(TAGS) * 9
    assert min(seeds) >= 2**32 and max(seeds) < 2**63
    assert stream_seed(0, "dgc", 0) == stream_seed(0, "dgc", 0)  # a pure function: every rank agrees
    assert stream_seed(0, "powersgd", key="fc.weight") != stream_seed(0, "powersgd", key="fc.bias")


def test_rank_generators_draw_per_rank_and_load_an_old_single_state():
    draws = []
    for rank in range(3):
        random = RankGenerator(5, "terngrad")
        random.bind(rank)
        draws.append(torch.rand(4, generator=random("cpu")))
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[1], draws[2])
    assert not torch.equal(draws[0], torch.rand(4, generator=torch.Generator().manual_seed(0)))

    source = RankGenerator(5, "pactrain")
    source.bind(2)
    source("cpu")
    old = source.state_dict()["cpu"]  # what a checkpoint of one CPU generator held
    expected = torch.rand(3, generator=source("cpu"))
    resumed = RankGenerator(5, "pactrain")
    resumed.load_state_dict(old)
    assert torch.equal(torch.rand(3, generator=resumed("cpu")), expected)


@pytest.mark.parametrize("clip", [0.0, 2.5, math.inf])
def test_segment_scales_cap_at_clip_std_only_where_the_cap_is_positive(clip):
    values = torch.tensor([1.0, -3.0, 0.5, 7.0, -2.0, 4.0, 4.0, -10.0])
    lengths = (6, 1, 0, 1)  # a one-entry segment has std 0; an empty one is skipped
    scales = segment_scales(values, lengths, clip)
    first = values[:6]
    expected = first.abs().max()
    if 0 < clip < math.inf:
        expected = torch.minimum(expected, clip * first.std(correction=0))
    assert torch.equal(scales, torch.stack([expected, torch.tensor(4.0), torch.tensor(0.0), torch.tensor(10.0)]))


def test_draw_units_are_uniform_on_the_grid_of_one_to_two():
    """Every draw on 1 + j / 2^23; chi-square over 64 bins of the fraction (and of its low bits) within reason;
    the same stream gives the same draws."""
    words = torch.empty(2**15, dtype=torch.int64)
    draws = draw_units(words, 2**16, torch.float32, torch.Generator().manual_seed(3)).clone()
    assert draws.dtype == torch.float32 and ((draws >= 1) & (draws < 2)).all()
    j = ((draws.double() - 1) * 2**23)
    assert torch.equal(j, j.round())
    expected = draws.numel() / 64
    for bins in (torch.floor((draws - 1) * 64).long(), j.long() % 64):  # high bits, low bits
        chi2 = ((torch.bincount(bins, minlength=64) - expected) ** 2 / expected).sum()
        assert chi2 < 120  # 63 degrees of freedom: p < 1e-5 above 120
    again = draw_units(torch.empty_like(words), 2**16, torch.float32, torch.Generator().manual_seed(3))
    assert torch.equal(again, draws)
    wide = draw_units(torch.empty(64, dtype=torch.int64), 64, torch.float64, torch.Generator().manual_seed(3))
    assert wide.dtype == torch.float64 and ((wide >= 1) & (wide < 2)).all()


@pytest.mark.parametrize("z", [0.0, 0.25, -0.25, 0.5 + 2.0**-10, -1.0 + 2.0**-12, -1.5, 3.75, -126.5, 126.0 + 2.0**-9])
def test_add_scaled_rounds_up_with_probability_equal_to_the_fractional_part(z):
    """Over all 2^23 draws of the fp32 grid, floor(z + w) is floor(z) + 2 for frac(z) * 2^23 of them and
    floor(z) + 1 for the rest: exactly while z + w stays on fp32's grid (|z| < 1 here), and otherwise more by
    the draws that round up onto the boundary, half an fp32 ulp of it (2 draws at 5, 32 at 128)."""
    w = 1.0 + torch.arange(2**23, dtype=torch.float64).div_(2**23).float()
    values = torch.full((2**23,), z)
    out = add_scaled_(w, values, torch.tensor([1.0]), (2**23,)).floor_()
    low = math.floor(z)
    assert set(out.unique().tolist()) <= {low + 1.0, low + 2.0}
    boundary = abs(low + 2)
    ulp = 2.0 ** (math.floor(math.log2(boundary - 1e-9)) - 23) if boundary > 2 else 0.0  # fp32's below it
    excess = int((out == low + 2).sum()) - round((z - low) * 2**23)
    assert excess == round(ulp / 2 * 2**23)
