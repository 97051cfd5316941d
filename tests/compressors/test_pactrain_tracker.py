"""PacTrain's mask tracker (``gcomp.compressors.pactrain.tracker``): its state machine, step by step, on simulated
ranks; its checkpoint entries; DDP's buffer broadcasts told from mask edits (``SyncBumps``).

Each rank is a copy of one small pruned model with its own ``MaskTracker``; the collectives the tracker relies
on are computed here: the MAX of the tracking flags, the SUM of the packed steps' "changed" counters. The same
machine inside DDP (warm-up, rebuild, real ranks) is tested in tests/compressors/test_pactrain.py.
"""
from __future__ import annotations

import copy
import pickle
import warnings
from typing import Callable

import pytest
import torch
from torch import nn
from torch.nn.utils import prune

from gcomp import BucketInfo
from gcomp.compressors.pactrain.support import bucket_support
from gcomp.compressors.pactrain.tracker import (DENSE, PACKED, TRACKING, BucketTrack, Carry, HostFlags, MaskTracker,
                                               Slot, flag_set, receive_changed, receive_flags,
                                               tracking_flags)
from gcomp.pruning.masks import SyncBumps
from gcomp.testing.ops import counting

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


def _builder(tracker: MaskTracker, info: BucketInfo, calls: list | None = None):
    """A support builder as the codec passes one (``masks -> Support``), noting each call's masks in ``calls``."""
    params = dict(tracker.model.named_parameters()) if tracker.model is not None else {}

    def build(masks):
        if calls is not None:
            calls.append(masks)
        layout = [(torch.Size([n]), (1,), None) if m is None else (params[name].size(), params[name].stride(), m)
                  for name, n, m in zip(info.names, info.numels, masks)]
        return bucket_support(layout, info.numel, "cpu")

    return build


def _decide(tracker: MaskTracker, info: BucketInfo):
    return tracker.decide(info, _builder(tracker, info))


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
        decided = [_decide(t, info) for t in self.trackers]
        modes = {track.mode for track, _ in decided}
        assert len(modes) == 1, f"ranks disagree on the mode: {modes}"
        mode = modes.pop()
        if mode == TRACKING:
            flags = torch.stack([tracking_flags(track, changed, "cpu") for track, changed in decided]).amax(0)
            for track, _ in decided:
                receive_flags(track, flags.clone())
        elif mode == PACKED:
            changed = torch.tensor([float(sum(changed for _, changed in decided))])
            for track, _ in decided:
                receive_changed(track, changed.clone())
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
    assert torch.equal(ranks.tracks[0].support.positions.long(), expected.nonzero().reshape(-1))


def test_candidate_digest_is_sent_on_the_candidate_step_only():
    ranks = Ranks(2, stable_steps=2)
    info = _info(ranks.models[0], BUCKET)
    sent = []
    for _ in range(3):
        track, changed = _decide(ranks.trackers[0], info)
        sent.append(tracking_flags(track, changed, "cpu"))
        for t in ranks.trackers[1:]:
            _decide(t, info)
        for t in ranks.trackers:
            receive_flags(t.tracks[info.key], torch.zeros(5, dtype=torch.int64))
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
        track, changed = _decide(tracker, info)
        modes.append(track.mode)
        if track.mode == TRACKING:
            receive_flags(track, tracking_flags(track, changed, "cpu"))
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
    assert all(t.support is None and t.carry == Carry() for t in ranks.tracks)
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
    first, changed = _decide(ranks.trackers[0], info)
    flags = tracking_flags(first, changed, "cpu")
    assert flags[2] == int(_support(ranks.models[0], BUCKET).sum())  # the candidate goes with the first step
    for t in ranks.trackers[1:]:
        _decide(t, info)
    everyone = torch.stack([tracking_flags(t.tracks[info.key], False, "cpu") for t in ranks.trackers]).amax(0)
    for t in ranks.trackers:
        receive_flags(t.tracks[info.key], everyone.clone())
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


# --- what a track carries, its checkpoint entries, supports built by the caller ----------------------------------

def _fill(track, kept: int) -> None:
    """Everything the ternary path carries on a frozen support, as after some steps."""
    track.carry = Carry(residual=torch.ones(kept), exponents=torch.tensor([3, -2, 0, 1]),  # one per parameter
                        scale=torch.tensor([1.5, 0.5, 1.0, 1.0]), resync=HostFlags(torch.tensor([False])))


def test_the_carry_goes_with_the_support_when_a_track_unfreezes():
    """The step that sees an edit is still packed and keeps the carry; the next one unfreezes every rank's track,
    and with the support go the residual, the carried scale and a pending resync, which the checkpoint shows."""
    ranks = Ranks(2, stable_steps=1)
    info = _info(ranks.models[0], BUCKET)
    assert ranks.steps(info, 3)[-1] == PACKED
    held = []
    for track in ranks.tracks:
        _fill(track, track.support.kept)
        held.append(track.carry)
    assert set(ranks.trackers[0].state_dict()[info.key]) == {"mode", "stable", "pending", "digest", "residual",
                                                             "exponents", "names"}
    _edit_in_place(ranks.models[1])
    assert ranks.step(info) == PACKED and all(t.carry is c for t, c in zip(ranks.tracks, held))
    with pytest.warns(RuntimeWarning, match="changed on some rank"):
        assert ranks.step(info) == TRACKING
    assert all(t.support is None and t.carry == Carry() for t in ranks.tracks)
    assert set(ranks.trackers[0].state_dict()[info.key]) == {"mode", "stable", "pending", "names"}


def test_checkpoint_entries_hold_the_carry_and_give_it_back():
    """``state_dict`` writes the carry's residual and exponents (the exponents left out while a resync is
    pending); a tracker loading the entry takes them up, the scale to be derived again and no resync pending."""
    ranks = Ranks(1, stable_steps=1)
    info = _info(ranks.models[0], BUCKET)
    ranks.steps(info, 3)
    track = ranks.tracks[0]
    _fill(track, track.support.kept)
    entry = ranks.trackers[0].state_dict()[info.key]
    assert list(entry) == ["mode", "stable", "names", "pending", "digest", "residual", "exponents"]
    assert entry["residual"] is track.carry.residual and torch.equal(entry["exponents"], torch.tensor([3, -2, 0, 1]))
    track.carry.resync = HostFlags(torch.tensor([True]))
    assert "exponents" not in ranks.trackers[0].state_dict()[info.key]

    resumed = Ranks(1, stable_steps=1)
    resumed.trackers[0].load_state_dict({info.key: entry})
    restored, _ = _decide(resumed.trackers[0], info)
    assert restored.mode == PACKED and torch.equal(restored.support.digest, track.support.digest)
    carry = restored.carry
    assert torch.equal(carry.residual, entry["residual"]) and torch.equal(carry.exponents, entry["exponents"])
    assert carry.scale is None and carry.resync is None


@pytest.mark.parametrize("entry, message", [
    ({"mode": "frozen", "stable": 0}, "'mode' must be one of"),
    ({"mode": "packed", "stable": 0}, "needs the 'digest'"),
    ({"mode": "tracking", "stable": -1}, "'stable' must be at least 0"),
    ({"mode": "packed", "stable": 0, "digest": torch.tensor([1, 3]), "residual": torch.ones(4)}, "keeps 3"),
    ({"mode": "packed", "stable": 0, "digest": torch.tensor([1, 3]), "residual": torch.tensor([1.0, float("nan"), 0])},
     "non-finite"),
    ({"mode": "tracking", "stable": 0, "names": ["x"]}, "not those of layout"),
])
def test_bad_checkpoint_entries_fail_at_load(entry, message):
    info = BucketInfo.from_layout(0, torch.float32, ["a", "b"], [3, 4])
    with pytest.raises(ValueError, match=message):
        MaskTracker().load_state_dict({info.key: entry})


@pytest.mark.parametrize("installed", [False, True], ids=["candidate", "agreed-at-install"])
def test_decide_builds_the_layouts_supports_with_the_builder_it_is_given(installed):
    """Every support of the layout comes from ``build``: the candidate (or the agreed masks' copy at install),
    the frozen one, and the one a checkpoint is compared with on restore."""
    ranks = Ranks(2, stable_steps=1, as_installed=installed)
    info = _info(ranks.models[0], BUCKET)
    if installed:  # every rank's digest of its masks agreed at install: it freezes at its first step
        flags = torch.stack([t.install_flags() for t in ranks.trackers]).amax(0)
        for t in ranks.trackers:
            t.receive_install_flags(flags)
    calls = [[] for _ in ranks.trackers]
    for _ in range(3):
        decided = [t.decide(info, _builder(t, info, c)) for t, c in zip(ranks.trackers, calls)]
        if decided[0][0].mode == TRACKING:
            flags = torch.stack([tracking_flags(track, changed, "cpu") for track, changed in decided]).amax(0)
            for track, _ in decided:
                receive_flags(track, flags.clone())
        else:
            for track, _ in decided:
                receive_changed(track, torch.zeros(1))
    track = decided[0][0]
    assert track.mode == PACKED and track.support is not None and len(calls[0]) == 1
    assert len(calls[0][0]) == len(info.names) and any(m is not None for m in calls[0][0])
    if installed:  # the bool copies of the masks agreed at install
        assert all(m is None or m.dtype == torch.bool for m in calls[0][0])

    saved = ranks.trackers[0].state_dict()
    resumed = Ranks(1, stable_steps=1)
    resumed.trackers[0].load_state_dict(saved)
    calls_resumed: list = []
    restored, _ = resumed.trackers[0].decide(info, _builder(resumed.trackers[0], info, calls_resumed))
    assert len(calls_resumed) == 1 and restored.mode == PACKED
    # a builder that makes another support: the checkpointed digest no longer matches, the track starts over
    other = Ranks(1, stable_steps=1)
    other.trackers[0].load_state_dict(saved)
    whole = lambda masks: bucket_support([(torch.Size([info.numel]), (1,), None)], info.numel, "cpu")  # noqa: E731
    assert other.trackers[0].decide(info, whole)[0].mode == TRACKING


# --- the host reads: one per step, nothing waited for on a packed step -------------------------------------------

def test_the_mask_check_waits_for_nothing():
    ranks = Ranks(1, stable_steps=1, check_every=1)
    info = _info(ranks.models[0], BUCKET)
    ranks.steps(info, 3)
    tracker = ranks.trackers[0]
    with counting() as counter:
        unchanged = tracker._edited_in_place(info, ranks.tracks[0])
        ranks.models[0][0].weight_mask.data.view(-1)[0] = 1 - ranks.models[0][0].weight_mask.data.view(-1)[0]
        edited = tracker._edited_in_place(info, ranks.tracks[0])
    assert not counter.syncs and isinstance(edited, torch.Tensor)
    assert not bool(unchanged) and bool(edited)


def test_the_resync_flag_rides_in_the_trackers_copy_and_is_read_once():
    """A one-round step's resync flag, left in the carry as a tensor, goes to the host in the tracker's copy of
    its flags; both readers then share one ``tolist``."""
    track = BucketTrack()
    track.carry.resync = torch.tensor([1]) > 0
    receive_changed(track, torch.tensor([0.0]))
    assert isinstance(track.carry.resync, Slot) and track.pending.host.tolist() == [False, True, True]
    with counting() as counter:
        assert track.pending.values()[:2] == [False, True]
        assert flag_set(track.carry.resync)
    assert counter.syncs == {"tolist": 1}
    receive_changed(track, torch.tensor([2.0]))  # no resync pending: the two flags of before
    assert track.pending.host.tolist() == [True, True]


# --- DDP's re-sending of the masks at every forward (an in-place copy on torch up to 2.12) is no edit ------------

class BroadcastingWrapper(nn.Module):
    """What DDP on torch up to 2.12 does at each forward with ``broadcast_buffers=True``: copies rank 0's
    buffers into the module's in place (bumping their ``_version``), then runs the module."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x):
        with torch.no_grad():
            for buffer in self.module.buffers():
                buffer.copy_(buffer.clone())
        return self.module(x)


def _pruned() -> nn.Module:
    model = nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 2))
    prune.random_unstructured(model[0], "weight", 0.5)
    return model


def test_a_broadcast_leaves_the_signature_and_an_edit_changes_it():
    model = _pruned()
    wrapper = BroadcastingWrapper(model)
    tracker = MaskTracker()
    tracker.watch(wrapper)
    tracker.bind(model, {})
    params = dict(model.named_parameters())
    info = BucketInfo.from_layout(0, torch.float32, params, [p.numel() for p in params.values()])
    before = tracker._signature(info)
    for _ in range(3):
        wrapper(torch.randn(2, 6))
    assert model[0].weight_mask._version > 1  # the copies did bump it
    assert tracker._signature(info) == before
    model[0].weight_mask.mul_(1)  # an edit in place, outside the broadcast
    assert tracker._signature(info) != before


def test_sync_bumps_count_only_what_the_wrapped_forward_added_and_stop_on_close():
    model = _pruned()
    wrapper = BroadcastingWrapper(model)
    bumps = SyncBumps()
    bumps.watch(wrapper)
    mask = model[0].weight_mask
    wrapper(torch.randn(1, 6))
    wrapper(torch.randn(1, 6))
    assert bumps.discount(mask) == 2
    model(torch.randn(1, 6))  # the module alone (no broadcast before it) adds nothing
    assert bumps.discount(mask) == 2
    bumps.close()
    wrapper(torch.randn(1, 6))
    assert bumps.discount(mask) == 2


def test_a_copy_of_sync_bumps_watches_nothing():
    bumps = SyncBumps()
    bumps.watch(BroadcastingWrapper(_pruned()))
    for twin in (copy.deepcopy(bumps), pickle.loads(pickle.dumps(bumps))):
        assert twin.bumps == {} and twin._handles == []


def test_a_model_that_does_not_resend_its_buffers_gets_no_hooks():
    model = _pruned()
    wrapper = BroadcastingWrapper(model)
    wrapper.broadcast_buffers = False  # as DDP built with no_buffer_sync() reads
    bumps = SyncBumps()
    bumps.watch(wrapper)
    assert bumps._handles == [] and not wrapper._forward_pre_hooks and not model._forward_pre_hooks
