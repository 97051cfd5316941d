"""PacTrain's ternary codec as a component (``gcomp.compressors.pactrain_ternary``): made and bound on its own, with
no compressor around it, driven part by part on a small support; and the one-round lane layout that DDP's lanes
and FSDP2's rows share (``fill_lanes``, ``split_lanes``). The codec inside PacTrain, on simulated and real ranks:
tests/compressors/test_pactrain.py."""
from __future__ import annotations

import pytest
import torch

from gcomp.compressors import scale_grid
from gcomp.compressors.pactrain_ternary import FLAGS, TernaryCodec, fill_lanes, split_lanes, split_scales
from gcomp.compressors.quantise import RankGenerator
from gcomp.packing.state import Carry, LayoutState, TernaryWork
from gcomp.packing.support import SupportIndex

NUMELS = (6, 20, 14)  # three parameters: a bucket's segments


def _support() -> tuple[SupportIndex, torch.Tensor]:
    kept = torch.ones(sum(NUMELS), dtype=torch.bool)
    kept[[0, 7, 8, 9, 21, 30, 31]] = False
    return SupportIndex(kept, NUMELS), kept


def _gradient(kept: torch.Tensor) -> torch.Tensor:
    g = torch.randn(kept.numel(), generator=torch.Generator().manual_seed(3)) * kept
    g[10] = 0.0  # a kept entry at zero: decoded exactly 0
    return g


def test_the_codec_needs_no_host_a_standalone_one_runs_every_part_on_one_rank_unbiased():
    """Made with its configuration and its own generator, bound with a world size and a counter, the codec runs
    gather -> scales -> codes -> pack -> unpack -> decode with only the support and the layout's state passed in:
    on 1 rank (fixed seed) the decoded values are ``scale * t`` (t in {-1, 0, 1}, the right shape, zero off the
    support) and their mean over many steps is the gradient, within 6 standard errors."""
    support, kept = _support()
    grad = _gradient(kept)
    counted: list[str] = []
    codec = TernaryCodec(rounds=2, random=RankGenerator(11, "test"))
    codec.bind(1, counted.append)
    state = LayoutState()
    samples, total = 2000, torch.zeros(grad.numel(), dtype=torch.float64)
    for step in range(samples):
        values = codec.gather_values(support, state, grad)
        assert torch.equal(values, grad[kept]) and isinstance(state.ternary, TernaryWork)
        scales = codec.local_scales(support, state, changed=step == 0)
        assert scales.shape == (len(NUMELS) + 2,) and scales[-2] == (step == 0) and scales[-1] == 0
        assert codec.carried_scale(state.carry) is None  # rounds=2: never one round
        words = codec.code_words(support, state, split_scales(scales)[0])  # the MAX over 1 rank: scales
        assert words.dtype == torch.int64 and words.shape == (codec.words(support.kept),)
        shared, nonfinite, changed = codec.receive_scales(state.carry, scales)  # the SUM over 1 rank: words
        assert changed.item() == (step == 0) and state.carry.exponents is not None
        decoded = support.scatter(codec.decode_values(support, state, shared, nonfinite, words),
                                  torch.full_like(grad, float("nan")))
        assert decoded.shape == grad.shape and (decoded[~kept] == 0).all()
        total += decoded.double()
    assert counted == []  # two rounds, no resync: nothing to count
    scale = torch.cat([torch.full((part.numel(),), float(part.abs().max())) for part in grad.split(NUMELS)]).double()
    mean, g = total / samples, grad.double()
    assert mean[10] == 0 and (mean[~kept] == 0).all()
    variance = scale * g.abs() - g**2
    assert ((mean - g).abs() <= 6 * (variance / samples).sqrt() + 1e-6).all()


def test_a_standalone_codec_goes_one_round_with_the_scale_it_carried_and_counts_it():
    support, kept = _support()
    grad = _gradient(kept)
    counted: list[str] = []
    codec = TernaryCodec(random=RankGenerator(5, "test"))  # rounds=1
    codec.bind(1, counted.append)
    state = LayoutState()
    codec.gather_values(support, state, grad)
    scales = codec.local_scales(support, state)
    assert codec.carried_scale(state.carry) is None  # the first packed step: two rounds
    words = codec.code_words(support, state, scales[:-2])
    codec.receive_scales(state.carry, scales)
    codec.decode_values(support, state, scales[:-2], scales[-1], words)
    for _ in range(3):
        codec.gather_values(support, state, grad)
        scales = codec.local_scales(support, state)
        exponents, shared = codec.carried_scale(state.carry)
        assert torch.equal(shared, scale_grid.grid_scale(exponents))
        lanes = codec.one_round_lanes(support, state, scales, exponents, shared)
        n = codec.words(support.kept)
        assert lanes.shape == (n + scale_grid.hist_words(len(NUMELS), 1) + FLAGS,)
        code_words, nonfinite, changed = codec.receive_lanes(state.carry, lanes, n, exponents)
        decoded = codec.decode_values(support, state, shared, nonfinite, code_words)
        steps = decoded / shared.repeat_interleave(torch.tensor(support.segments))
        assert torch.equal(steps, steps.round()) and steps.abs().max() <= 1 and changed.item() == 0
    assert counted == ["one_round_buckets"] * 3


def test_the_codec_keeps_its_residual_in_the_carry_with_error_feedback():
    support, kept = _support()
    grad = _gradient(kept)
    codec = TernaryCodec(error_feedback=True, rounds=2, random=RankGenerator(1, "test"))
    codec.bind(1)
    state = LayoutState()
    values = codec.gather_values(support, state, grad).clone()
    scales = codec.local_scales(support, state)
    words = codec.code_words(support, state, scales[:-2])
    decoded = codec.decode_values(support, state, scales[:-2], scales[-1], words).clone()
    assert isinstance(state.carry, Carry) and torch.allclose(state.carry.residual + decoded, values)


@pytest.mark.parametrize("lead", [(), (4,)], ids=["ddp-flat", "fsdp-rows"])
def test_the_lane_layout_round_trips_for_a_flat_vector_and_for_rows(lead):
    """``fill_lanes`` lays out code words, counting lanes and the 3 counts (non-finite, changed, resync) for
    DDP's flat lanes and alike in every row of FSDP2's (world, ...) matrix; ``split_lanes`` takes a received
    vector apart again."""
    words = torch.arange(1, 1 + 3 * (lead[0] if lead else 1), dtype=torch.int64).reshape(*lead, 3)
    hist = torch.tensor([7, 8], dtype=torch.int64)
    scales = torch.tensor([0.5, 2.0, 1.0, 0.0])  # two scales, then changed, non-finite
    lanes = fill_lanes(words, hist, scales, torch.tensor(2))  # (a resync count of 2: told apart from the others)
    assert lanes.shape == (*lead, 3 + 2 + FLAGS) and lanes.dtype == torch.int64
    for r, row in enumerate(lanes.reshape(-1, lanes.shape[-1])):
        codes, got_hist, nonfinite, changed, resync = split_lanes(row, 3)
        assert torch.equal(codes, words.reshape(-1, 3)[r]) and torch.equal(got_hist, hist)
        assert (nonfinite.shape, changed.shape, resync.shape) == ((), (1,), (1,))
        assert (int(nonfinite), int(changed), int(resync)) == (0, 1, 2)
    rows = lanes.reshape(-1, lanes.shape[-1])
    _, got_hist, nonfinite, changed, resync = split_lanes(rows.sum(0), 3)  # summed: each slot adds up apart
    assert torch.equal(got_hist, len(rows) * hist)
    assert (int(nonfinite), int(changed), int(resync)) == (0, len(rows), 2 * len(rows))
