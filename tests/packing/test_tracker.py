"""PacTrain's mask tracker (``gcomp.packing.tracker``): its state machine, step by step, on simulated ranks.

Each rank is a copy of one small pruned model with its own ``MaskTracker``; the collectives the tracker relies
on are computed here: the MAX of the tracking flags, the SUM of the packed steps' "changed" counters. The same
machine inside DDP (warm-up, rebuild, real ranks) is tested in tests/compressors/test_pactrain.py.
"""
from __future__ import annotations

import warnings
from typing import Callable

import pytest
import torch
from torch import nn
from torch.nn.utils import prune

from gcomp import BucketInfo
from gcomp.packing.state import LayoutState
from gcomp.packing.tracker import DENSE, PACKED, TRACKING, MaskTracker

STATS = ("freezes", "unfreezes", "mask_mismatches")


def _model(seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(10, 8), nn.Linear(8, 4))
    for layer in model:
        prune.custom_from_mask(layer, "weight", (torch.rand(layer.weight.shape, generator=g) < 0.5).float())
    return model


def _info(model: nn.Module, names: list[str], index: int = 0) -> BucketInfo:
    params = dict(model.named_parameters())
    return BucketInfo.from_layout(index, torch.float32, names, [params[n].numel() for n in names])


BUCKET = ["1.bias", "1.weight_orig", "0.bias", "0.weight_orig"]  # DDP's order: last layer first


class Ranks:
    """``world`` simulated ranks, each with its own copy of the model (``build()``) and its own tracker."""

    def __init__(self, world: int, stable_steps: int = 2, dense_above: float = 0.9,
                 build: Callable[[], nn.Module] = _model, check_every: int = 10, as_installed: bool = False):
        """``as_installed``: the masks stay those the trackers were bound with (packed after one step);
        otherwise every mask is touched after binding (its version bumped, its contents as they were), so the
        trackers wait ``stable_steps`` as for masks that change during training."""
        self.models = [build() for _ in range(world)]
        self.stats = [{k: 0 for k in STATS} for _ in range(world)]
        self.trackers = [MaskTracker(stable_steps, dense_above, check_every=check_every) for _ in range(world)]
        for tracker, m, s in zip(self.trackers, self.models, self.stats):
            tracker.bind(m, s)
            if not as_installed:
                _touch(m)
        self.tracks: list = []

    def step(self, info: BucketInfo) -> str:
        """Every rank decides; the flags or counters they send are reduced and handed back. Returns the mode."""
        decided = [t.decide(info, "cpu") for t in self.trackers]
        modes = {track.mode for track, _ in decided}
        assert len(modes) == 1, f"ranks disagree on the mode: {modes}"
        mode = modes.pop()
        if mode == TRACKING:
            flags = torch.stack([MaskTracker.flags(track, changed, "cpu") for track, changed in decided]).amax(0)
            for track, _ in decided:
                MaskTracker.receive_flags(track, flags.clone())
        elif mode == PACKED:
            changed = torch.tensor([float(sum(changed for _, changed in decided))])
            for track, _ in decided:
                MaskTracker.receive_changed(track, changed.clone())
        self.tracks = [track for track, _ in decided]
        return mode

    def steps(self, info: BucketInfo, n: int) -> list[str]:
        return [self.step(info) for _ in range(n)]

    def stat(self, key: str) -> int:
        values = {s[key] for s in self.stats}
        assert len(values) == 1, f"ranks count {key} differently: {values}"
        return values.pop()


def _support(model: nn.Module, names: list[str]) -> torch.Tensor:
    params = dict(model.named_parameters())
    masks = {n + "_orig": b for n, b in ((n.removesuffix("_mask"), b) for n, b in model.named_buffers())}
    return torch.cat([(masks[n] != 0).reshape(-1) if n in masks else torch.ones(params[n].numel(), dtype=torch.bool)
                      for n in names])


def _touch(model: nn.Module) -> None:
    """Bump every mask's version, its contents unchanged (as re-writing it in place would)."""
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("_mask"):
                buffer.mul_(1)


def _edit_in_place(model: nn.Module, count: int = 3) -> None:
    flat = model[0].weight_mask.view(-1)
    flat[flat.nonzero().reshape(-1)[:count]] = 0


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("stable_steps", [1, 2, 5])
def test_freezes_after_stable_steps_and_packs_the_mask_support(world, stable_steps):
    ranks = Ranks(world, stable_steps)
    info = _info(ranks.models[0], BUCKET)
    modes = ranks.steps(info, stable_steps + 4)
    assert modes == [TRACKING] * (stable_steps + 1) + [PACKED] * 3
    assert ranks.stat("freezes") == 1 and ranks.stat("unfreezes") == ranks.stat("mask_mismatches") == 0
    expected = _support(ranks.models[0], BUCKET)
    for track in ranks.tracks:
        assert track.support.kept == int(expected.sum()) and track.support.numel == info.numel
        assert torch.equal(track.support.digest, ranks.tracks[0].support.digest)
    bucket = torch.arange(1.0, info.numel + 1)
    assert torch.equal(ranks.tracks[0].support.scatter(bucket[expected], torch.empty(info.numel)),
                       torch.where(expected, bucket, 0.0))


def test_candidate_digest_is_sent_on_the_candidate_step_only():
    ranks = Ranks(2, stable_steps=2)
    info = _info(ranks.models[0], BUCKET)
    sent = []
    for _ in range(3):
        track, changed = ranks.trackers[0].decide(info, "cpu")
        sent.append(MaskTracker.flags(track, changed, "cpu"))
        for t in ranks.trackers[1:]:
            t.decide(info, "cpu")
        for t in ranks.trackers:
            MaskTracker.receive_flags(t.tracks[info.key], torch.zeros(5, dtype=torch.int64))
    assert [bool(f[1:].any()) for f in sent] == [False, False, True]
    assert sent[2][2] == int(_support(ranks.models[0], BUCKET).sum())  # the digest's count of kept entries
    assert torch.equal(sent[2][1:3], -sent[2][3:5])


def test_unpruned_bucket_freezes_into_dense_mode_for_good():
    ranks = Ranks(2, stable_steps=2)
    info = _info(ranks.models[0], ["1.bias", "0.bias"])
    assert ranks.steps(info, 8) == [TRACKING] * 3 + [DENSE] * 5
    assert ranks.stat("freezes") == 1


@pytest.mark.parametrize("kept, mode", [(4, PACKED), (5, DENSE)])
def test_dense_above_is_a_strict_threshold(kept, mode):
    def build() -> nn.Module:
        model = nn.Linear(8, 1, bias=False)
        return prune.custom_from_mask(model, "weight", (torch.arange(8) < kept).float().reshape(1, 8))

    ranks = Ranks(1, stable_steps=1, dense_above=0.5, build=build)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ranks.steps(_info(ranks.models[0], ["weight_orig"]), 3) == [TRACKING, TRACKING, mode]
    said = [str(w.message) for w in caught if "dense_above" in str(w.message)]
    # a pruned bucket that goes dense says so once (its ternary, if any, does not apply); a packed one says nothing
    assert said == ([] if mode == PACKED else ["pactrain: bucket 0 keeps 62% of its entries after pruning, more "
                                               "than dense_above=0.5: it travels as a plain dense all-reduce, neither "
                                               "packed nor ternarised; prune more or raise dense_above to pack it"])


def test_without_a_model_every_entry_is_kept_and_the_bucket_goes_dense():
    tracker, stats = MaskTracker(stable_steps=1), {k: 0 for k in STATS}
    tracker.bind(None, stats)
    info = BucketInfo.from_layout(0, torch.float32, ["a", "b"], [3, 4])
    modes = []
    for _ in range(3):
        track, changed = tracker.decide(info, "cpu")
        modes.append(track.mode)
        if track.mode == TRACKING:
            MaskTracker.receive_flags(track, MaskTracker.flags(track, changed, "cpu"))
    assert modes == [TRACKING, TRACKING, DENSE] and stats["freezes"] == 1


def test_a_rank_with_other_masks_never_freezes_and_warns_at_every_check():
    ranks = Ranks(3, stable_steps=2)
    ranks.models[1][0].weight_mask.view(-1)[0] = 1 - ranks.models[1][0].weight_mask.view(-1)[0]
    info = _info(ranks.models[0], BUCKET)
    ranks.step(info)  # rank 1's edit came before the first step: not a change, only a different mask
    with pytest.warns(RuntimeWarning, match="different masks") as caught:
        modes = ranks.steps(info, 8)
    assert modes == [TRACKING] * 8
    # a candidate every stable_steps + 1 = 3 steps, each checked (and failed) at the next: steps 3, 6 (and 9)
    assert ranks.stat("mask_mismatches") == 2 and ranks.stat("freezes") == 0
    assert len(caught) == 2 * 3  # every rank warns


def test_an_edit_on_one_rank_unfreezes_at_the_next_step():
    """The step that sees the edit still goes packed on the agreed support (every rank decides alike, and
    packing is what was agreed); the next step goes back to tracking on every rank, with a warning."""
    ranks = Ranks(2, stable_steps=2)
    info = _info(ranks.models[0], BUCKET)
    assert ranks.steps(info, 4)[-1] == PACKED
    kept = ranks.tracks[0].support.kept
    _edit_in_place(ranks.models[1])
    assert ranks.step(info) == PACKED and ranks.tracks[0].support.kept == kept
    with pytest.warns(RuntimeWarning, match="changed on some rank"):
        assert ranks.step(info) == TRACKING
    assert ranks.stat("unfreezes") == 1
    assert all(t.support is None and t.state == LayoutState() for t in ranks.tracks)
    with pytest.warns(RuntimeWarning, match="different masks"):
        assert ranks.steps(info, 6) == [TRACKING] * 6  # rank 1's support differs from now on
    assert ranks.stat("freezes") == 1


@pytest.mark.parametrize("how", ["in place", "replaced"])
def test_masks_changed_on_every_rank_refreeze_on_the_new_support(how):
    ranks = Ranks(2, stable_steps=2)
    info = _info(ranks.models[0], BUCKET)
    ranks.steps(info, 4)
    old = ranks.tracks[0].support.kept
    new_mask = (torch.arange(80) % 3 == 0).float().reshape(8, 10)
    for model in ranks.models:
        if how == "in place":
            _edit_in_place(model, 5)
        else:  # torch's PruningContainer: a new mask object, the product of the old and the new
            before = model[0].weight_mask
            prune.custom_from_mask(model[0], "weight", new_mask)
            assert model[0].weight_mask is not before
    expected = _support(ranks.models[0], BUCKET)
    assert int(expected.sum()) < old
    assert ranks.step(info) == PACKED  # the step of the change: the old support still
    with pytest.warns(RuntimeWarning, match="changed on some rank"):
        modes = ranks.steps(info, 5)
    assert modes == [TRACKING] * 3 + [PACKED] * 2
    assert ranks.stat("unfreezes") == 1 and ranks.stat("freezes") == 2 and ranks.stat("mask_mismatches") == 0
    for track in ranks.tracks:
        assert track.support.kept == int(expected.sum())


@pytest.mark.parametrize("at", [1, 2])
def test_a_change_while_tracking_restarts_the_count(at):
    """stable_steps=2: without a change the candidate goes at step 2 and the bucket freezes at step 3. A change
    on every rank seen at step ``at`` (2: the candidate step, whose candidate is dropped) is known to every rank
    at ``at + 1``, where the count restarts: the bucket freezes at ``at + 1 + 2 + 1``."""
    ranks = Ranks(2, stable_steps=2)
    info = _info(ranks.models[0], BUCKET)
    ranks.steps(info, at)
    for model in ranks.models:
        _edit_in_place(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a change while tracking is no mismatch and no unfreeze: no warning
        modes = ranks.steps(info, 8)
    assert at + modes.index(PACKED) == at + 1 + 2 + 1
    assert ranks.stat("freezes") == 1 and ranks.stat("mask_mismatches") == 0
    assert ranks.tracks[0].support.kept == int(_support(ranks.models[0], BUCKET).sum())


def test_each_bucket_layout_is_tracked_on_its_own():
    """A new layout (DDP's rebuild) starts tracking from scratch; the one frozen before stays frozen."""
    ranks = Ranks(2, stable_steps=1)
    whole = _info(ranks.models[0], BUCKET)
    ranks.steps(whole, 3)
    first, second = _info(ranks.models[0], BUCKET[:2], 0), _info(ranks.models[0], BUCKET[2:], 1)
    assert ranks.steps(first, 3) == [TRACKING, TRACKING, PACKED]
    assert ranks.steps(second, 3) == [TRACKING, TRACKING, PACKED]
    assert ranks.step(whole) == PACKED
    assert ranks.stat("freezes") == 3


def test_state_dict_restores_a_frozen_support_only_onto_the_same_masks():
    ranks = Ranks(2, stable_steps=2)
    info = _info(ranks.models[0], BUCKET)
    ranks.steps(info, 4)
    saved = [t.state_dict() for t in ranks.trackers]
    for value in saved[0][info.key].values():
        assert isinstance(value, (str, int, torch.Tensor)) or all(isinstance(n, str) for n in value)  # plain values
    assert saved[0][info.key]["names"] == BUCKET  # the layout's parameters, which the load checks sizes by

    same = Ranks(2, stable_steps=2)
    for t, s in zip(same.trackers, saved):
        t.load_state_dict(s)
    assert same.steps(info, 2) == [PACKED, PACKED] and same.stat("freezes") == 0
    assert same.tracks[0].support.kept == ranks.tracks[0].support.kept

    other = Ranks(2, stable_steps=2, build=lambda: _model(seed=1))
    for t, s in zip(other.trackers, saved):
        t.load_state_dict(s)
    assert other.steps(info, 4) == [TRACKING] * 3 + [PACKED]
    assert other.tracks[0].support.kept == int(_support(other.models[0], BUCKET).sum())


def test_state_dict_keeps_the_count_of_a_tracking_bucket():
    ranks = Ranks(1, stable_steps=2)
    info = _info(ranks.models[0], BUCKET)
    ranks.steps(info, 2)
    resumed = Ranks(1, stable_steps=2)
    resumed.trackers[0].load_state_dict(ranks.trackers[0].state_dict())
    assert resumed.steps(info, 3) == ranks.steps(info, 3) == [TRACKING, PACKED, PACKED]


def _edit_through_data(model: nn.Module, value: float, count: int = 3) -> None:
    """What ``mask.data[...] = v`` does: the mask's contents change, its ``_version`` does not."""
    data = model[0].weight_mask.data.view(-1)
    before = model[0].weight_mask._version
    data[(data != value).nonzero().reshape(-1)[:count]] = value
    assert model[0].weight_mask._version == before


@pytest.mark.parametrize("check_every", [1, 4])
def test_a_mask_edited_through_data_on_one_rank_is_caught_within_check_every_steps(check_every):
    """Before: the version check missed it, the bucket went on packed and the replicas diverged in silence.
    Now the frozen masks are compared every ``check_every`` packed steps; the edit rides in the packed
    payload's changed entry, every rank unfreezes, and their digests no longer agree (a warning, dense)."""
    ranks = Ranks(2, stable_steps=1, check_every=check_every)
    info = _info(ranks.models[0], BUCKET)
    assert ranks.steps(info, 4)[-1] == PACKED
    ranks.steps(info, 5)  # the count runs on between edits
    _edit_through_data(ranks.models[1], 0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        modes = ranks.steps(info, check_every + 5)
    first = modes.index(TRACKING)
    assert 1 <= first <= check_every and modes[:first] == [PACKED] * first, modes
    assert PACKED not in modes[first:], modes
    said = [str(w.message) for w in caught]
    assert any("changed on some rank" in m for m in said) and any("ranks hold different masks" in m for m in said)
    assert ranks.stat("unfreezes") == 1 and ranks.stat("mask_mismatches") >= 1


def test_unpruning_through_data_on_every_rank_refreezes_on_the_larger_support():
    """Un-pruning through ``.data`` used to leave those weights' gradients at 0 for good (they were off the
    frozen support); now the bucket re-tracks and packs the new support."""
    ranks = Ranks(2, stable_steps=1, check_every=2)
    info = _info(ranks.models[0], BUCKET)
    ranks.steps(info, 4)
    kept = ranks.tracks[0].support.kept
    for model in ranks.models:
        _edit_through_data(model, 1.0, count=5)
    with pytest.warns(RuntimeWarning, match="changed on some rank"):
        modes = ranks.steps(info, 8)
    assert modes[-1] == PACKED and ranks.stat("freezes") == 2
    assert ranks.tracks[0].support.kept == kept + 5 == int(_support(ranks.models[0], BUCKET).sum())


def test_check_every_zero_turns_the_check_off():
    ranks = Ranks(2, stable_steps=1, check_every=0)
    info = _info(ranks.models[0], BUCKET)
    ranks.steps(info, 4)
    _edit_through_data(ranks.models[1], 0.0)
    assert ranks.steps(info, 20) == [PACKED] * 20


@pytest.mark.parametrize("world", [1, 3])
def test_masks_as_installed_travel_packed_from_the_second_step(world):
    ranks = Ranks(world, stable_steps=5, as_installed=True)
    info = _info(ranks.models[0], BUCKET)
    first, changed = ranks.trackers[0].decide(info, "cpu")
    flags = MaskTracker.flags(first, changed, "cpu")
    assert flags[2] == int(_support(ranks.models[0], BUCKET).sum())  # the candidate goes with the first step
    for t in ranks.trackers[1:]:
        t.decide(info, "cpu")
    everyone = torch.stack([MaskTracker.flags(t.tracks[info.key], False, "cpu") for t in ranks.trackers]).amax(0)
    for t in ranks.trackers:
        MaskTracker.receive_flags(t.tracks[info.key], everyone.clone())
    assert ranks.steps(info, 3) == [PACKED] * 3  # not after stable_steps (5): no mask changed since install
    assert ranks.stat("freezes") == 1 and ranks.stat("mask_mismatches") == 0


def test_one_rank_whose_masks_changed_since_install_holds_every_rank_back_without_a_false_alarm():
    ranks = Ranks(3, stable_steps=2, as_installed=True)
    _touch(ranks.models[1])  # same contents, but not the masks it was installed with
    info = _info(ranks.models[0], BUCKET)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        modes = ranks.steps(info, 7)  # every step asserts that the ranks agree on the mode
    assert modes[:2] == [TRACKING, TRACKING] and PACKED in modes  # tracked as for changed masks, then packed
    assert ranks.stat("mask_mismatches") == 0 and not [w for w in caught if "different masks" in str(w.message)]


def test_an_unpruned_bucket_waits_as_before_even_as_installed():
    ranks = Ranks(2, stable_steps=2, as_installed=True)
    assert ranks.steps(_info(ranks.models[0], ["1.bias", "0.bias"]), 5) == [TRACKING] * 3 + [DENSE] * 2
