"""``gcomp.compressors.quantise``: random streams that cannot replay a user's small seeds, per-rank and shared;
per-segment scales by TernGrad's clipping rule."""
from __future__ import annotations

import math

import pytest
import torch

from gcomp.compressors.quantise import RankGenerator, segment_scales, stream_seed

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
