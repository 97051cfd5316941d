"""pactrain's ternary path on one simulated rank: error feedback keeps exactly what the codes did not carry, one-round
steps are counted; and its carried scale (``scale_grid.grid_scale`` and the counting lanes in the step's SUM)."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gcomp.compressors.pactrain import scale_grid as grid
from tests.compressors.test_pactrain import _compressors, _exchange, _reach, _tiny_pruned

POSITIVE = st.floats(min_value=2.0**-120, max_value=2.0**120, allow_nan=False, allow_infinity=False)


@settings(max_examples=300, deadline=None)
@given(st.lists(POSITIVE, min_size=1, max_size=20))
def test_grid_exponent_is_the_lowest_grid_point_at_or_above(values):
    m = torch.tensor(values, dtype=torch.float32)
    k = grid.grid_exponent(m)
    assert (grid.grid_scale(k) >= m).all()
    assert (grid.grid_scale(k - 1) < m).all()
    assert (grid.grid_scale(k) <= m * 2 ** (1 / grid.PER_OCTAVE) * (1 + 1e-6)).all()


def test_grid_scale_is_exact_on_octaves_and_zero_when_unset():
    k = torch.tensor([0, grid.PER_OCTAVE, -3 * grid.PER_OCTAVE, grid.UNSET])
    assert grid.grid_scale(k).tolist() == [1.0, 2.0, 0.125, 0.0]
    m = torch.tensor([0.0, math.nan, math.inf, 1.0])
    assert grid.grid_exponent(m).tolist() == [grid.UNSET, grid.UNSET, grid.UNSET, 0]


def _sum_over_ranks(local: list[torch.Tensor], k: torch.Tensor):
    world = len(local)
    lanes, flags = zip(*(grid.marks(m, k, world) for m in local))
    return torch.stack(lanes).sum(0), int(sum(flags))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 9), st.integers(1, 6), st.data())
def test_the_summed_lanes_give_the_grid_point_of_the_max_over_ranks(world, segments, data):
    """Every rank marks its own largest value; the SUM of the lanes tells the highest mark, so the next
    exponent is the grid point of the largest value over all ranks, exactly, as a MAX would give it."""
    k = torch.tensor(data.draw(st.lists(st.integers(-400, 400), min_size=segments, max_size=segments)))
    # each rank's largest value within the slots' span around this step's scale (or zero: no mark)
    local = []
    for _ in range(world):
        offsets = data.draw(st.lists(st.floats(-3.9, 3.8), min_size=segments, max_size=segments))
        zero = data.draw(st.lists(st.booleans(), min_size=segments, max_size=segments))
        local.append(torch.tensor([0.0 if z else float(grid.grid_scale(torch.tensor(kj))) * 2.0 ** o
                                   for kj, o, z in zip(k.tolist(), offsets, zero)], dtype=torch.float32))
    lanes, resync = _sum_over_ranks(local, k)
    assert resync == 0
    nxt = grid.next_exponent(lanes, k, world)
    largest = torch.stack(local).amax(0)
    expected = torch.where(largest > 0, grid.grid_exponent(largest), k)
    assert torch.equal(nxt, expected)


def test_a_value_beyond_the_span_or_without_a_scale_asks_for_a_resync():
    k = torch.tensor([0, grid.UNSET, 0])
    within = torch.tensor([1.5, 0.0, 0.0])
    assert _sum_over_ranks([within, within], k)[1] == 0
    assert _sum_over_ranks([within, torch.tensor([1.0, 0.0, 2.0**5])], k)[1] == 1  # 5 octaves up
    assert _sum_over_ranks([within, torch.tensor([1.0, 3.0, 0.0])], k)[1] == 1  # no scale yet
    # far below moves the scale down by the span at most, with no resync
    lanes, resync = _sum_over_ranks([torch.tensor([2.0**-20, 0.0, 0.0])], k)
    assert resync == 0 and grid.next_exponent(lanes, k, 1).tolist() == [-grid.CENTRE, grid.UNSET, 0]


@pytest.mark.parametrize("world", [2, 4, 1024])
def test_lanes_never_carry_into_the_next_slot(world):
    """Every rank marking the same slot sums to the world size, which the lane holds."""
    k = torch.zeros(3, dtype=torch.int64)
    lanes, _ = grid.marks(torch.tensor([1.0, 3.0, 0.25]), k, world)
    total = lanes * world  # all ranks alike
    assert grid.next_exponent(total, k, world).tolist() == grid.grid_exponent(torch.tensor([1.0, 3.0, 0.25])).tolist()
    assert lanes.numel() == grid.hist_words(3, world)


def test_grid_scale_is_the_table_of_eighth_octaves():
    k = torch.arange(-3 * grid.PER_OCTAVE, 3 * grid.PER_OCTAVE)
    expected = torch.tensor([2.0 ** (int(j) / grid.PER_OCTAVE) for j in k], dtype=torch.float32)
    assert torch.equal(grid.grid_scale(k), expected)


@pytest.mark.parametrize("rounds", [1, 2])
def test_error_feedback_keeps_what_the_codes_did_not_carry(rounds):
    """One rank: what it decodes plus the residual it keeps is its gradient on the support plus the residual it
    held, step after step (one round: against the carried scale, whose excess is in the residual too)."""
    model, info, support = _tiny_pruned()
    comps = _compressors(1, model, ternary=True, error_feedback=True, rounds=rounds)
    g = torch.Generator().manual_seed(7)
    _reach("ternary", comps, info, [torch.randn(info.numel, generator=g)])
    track = comps[0].tracker.tracks[info.key]
    for step in range(4):
        grad = torch.randn(info.numel, generator=g) * (3.0 if step == 2 else 1.0)
        held = track.carry.residual.clone()
        mode, decoded = _exchange(comps, info, [grad])
        assert mode == ("ternary" if rounds == 2 else "ternary1")
        kept = support.nonzero().reshape(-1)
        torch.testing.assert_close(decoded[0][kept] + track.carry.residual, grad[kept] + held)
        assert (decoded[0][~support] == 0).all()


def test_one_round_steps_and_resyncs_are_counted():
    model, info, _ = _tiny_pruned()
    comps = _compressors(2, model, ternary=True)
    for c in comps:
        c.stats = {"one_round_buckets": 0, "scale_resyncs": 0, "packed_buckets": 0}
    grads = [torch.randn(info.numel, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    _reach("ternary", comps, info, grads)
    assert [_exchange(comps, info, grads)[0] for _ in range(3)] == ["ternary1"] * 3
    assert all(c.stats == {"one_round_buckets": 3, "scale_resyncs": 0, "packed_buckets": 4} for c in comps)
