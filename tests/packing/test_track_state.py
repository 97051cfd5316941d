"""What the tracker keeps per layout for the method (``gcomp.packing.state``: ``LayoutState``, ``Carry``,
``TernaryWork``), its checkpoint entries (``gcomp.packing.checkpoint``), and supports built by the caller
(``MaskTracker.decide``'s ``build``). Simulated ranks as in test_tracker.py."""
from __future__ import annotations

import pytest
import torch

from gcomp.packing import Carry, LayoutState, TernaryWork
from gcomp.packing.host_flags import host_flag
from gcomp.packing.support import SupportIndex, bucket_support
from gcomp.packing.tracker import PACKED, TRACKING, MaskTracker
from tests.packing.test_tracker import BUCKET, Ranks, _edit_in_place, _info


def _fill(state: LayoutState, kept: int) -> None:
    """Everything a ternary (or lossless) method keeps on a frozen support, as after some steps."""
    state.carry = Carry(residual=torch.ones(kept), exponents=torch.tensor([3, -2, 0, 1]),  # one per parameter
                        scale=torch.tensor([1.5, 0.5, 1.0, 1.0]),
                        resync=host_flag(torch.tensor([False])))
    state.ternary = TernaryWork(*(torch.zeros(kept) for _ in range(5)), rows=torch.zeros(2, 3))
    state.packed = torch.zeros(kept + 1)


def test_the_layout_state_goes_with_the_support_when_a_track_unfreezes():
    """The step that sees an edit is still packed and keeps the state; the next one unfreezes every rank's
    track, and with the support go the carry (residual, carried scale, pending resync), the ternary work
    buffers and the packed buffer: the track starts over on an empty ``LayoutState``, which the checkpoint
    shows too (no residual, no exponents)."""
    ranks = Ranks(2, stable_steps=1)
    info = _info(ranks.models[0], BUCKET)
    assert ranks.steps(info, 3)[-1] == PACKED
    held = []
    for track in ranks.tracks:
        _fill(track.state, track.support.kept)
        held.append(track.state)
    assert set(ranks.trackers[0].state_dict()[info.key]) == {"mode", "stable", "pending", "digest", "residual",
                                                             "exponents", "names"}
    _edit_in_place(ranks.models[1])
    assert ranks.step(info) == PACKED and all(t.state is s for t, s in zip(ranks.tracks, held))
    with pytest.warns(RuntimeWarning, match="changed on some rank"):
        assert ranks.step(info) == TRACKING
    for track, old in zip(ranks.tracks, held):
        assert track.support is None and track.state is not old and track.state == LayoutState()
    assert set(ranks.trackers[0].state_dict()[info.key]) == {"mode", "stable", "pending", "names"}


def test_checkpoint_entries_hold_the_carry_and_give_it_back_typed():
    """``state_dict`` writes the carry's residual and exponents as the entry's ``residual`` and ``exponents``
    (the exponents left out while a resync is pending); a tracker loading the entry takes them up into the
    restored track's ``Carry``, the scale to be derived again and no resync pending."""
    ranks = Ranks(1, stable_steps=1)
    info = _info(ranks.models[0], BUCKET)
    ranks.steps(info, 3)
    track = ranks.tracks[0]
    _fill(track.state, track.support.kept)
    entry = ranks.trackers[0].state_dict()[info.key]
    assert list(entry) == ["mode", "stable", "names", "pending", "digest", "residual", "exponents"]
    assert entry["residual"] is track.state.carry.residual and torch.equal(entry["exponents"], torch.tensor([3, -2, 0, 1]))
    track.state.carry.resync = host_flag(torch.tensor([True]))
    assert "exponents" not in ranks.trackers[0].state_dict()[info.key]

    resumed = Ranks(1, stable_steps=1)
    resumed.trackers[0].load_state_dict({info.key: entry})
    restored, _ = resumed.trackers[0].decide(info, "cpu")
    assert restored.mode == PACKED and torch.equal(restored.support.digest, track.support.digest)
    carry = restored.state.carry
    assert torch.equal(carry.residual, entry["residual"]) and torch.equal(carry.exponents, entry["exponents"])
    assert carry.scale is None and carry.resync is None
    assert restored.state.ternary is None and restored.state.packed is None


def _flat(tracker: MaskTracker, info, calls: list):
    """A support builder as FSDP2's codec passes one (``masks -> Support``), here building what the tracker
    itself would, and noting each call's masks."""
    params = dict(tracker.model.named_parameters())

    def build(masks):
        calls.append(masks)
        layout = [(torch.Size([n]), (1,), None) if m is None else (params[name].size(), params[name].stride(), m)
                  for name, n, m in zip(info.names, info.numels, masks)]
        return SupportIndex(bucket_support(layout, info.numel), info.numels)

    return build


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
    builders = [_flat(t, info, c) for t, c in zip(ranks.trackers, calls)]
    for _ in range(3):
        decided = [t.decide(info, "cpu", build) for t, build in zip(ranks.trackers, builders)]
        if decided[0][0].mode == TRACKING:
            flags = torch.stack([MaskTracker.flags(track, changed, "cpu") for track, changed in decided]).amax(0)
            for track, _ in decided:
                MaskTracker.receive_flags(track, flags.clone())
        else:
            for track, _ in decided:
                MaskTracker.receive_changed(track, torch.zeros(1))
    track = decided[0][0]
    assert track.mode == PACKED and track.support is not None and len(calls[0]) == 1
    assert len(calls[0][0]) == len(info.names) and any(m is not None for m in calls[0][0])
    if installed:  # the bool copies of the masks agreed at install
        assert all(m is None or m.dtype == torch.bool for m in calls[0][0])

    saved = ranks.trackers[0].state_dict()
    resumed = Ranks(1, stable_steps=1)
    resumed.trackers[0].load_state_dict(saved)
    calls_resumed: list = []
    restored, _ = resumed.trackers[0].decide(info, "cpu", _flat(resumed.trackers[0], info, calls_resumed))
    assert len(calls_resumed) == 1 and restored.mode == PACKED
    # a builder that makes another support: the checkpointed digest no longer matches, the track starts over
    other = Ranks(1, stable_steps=1)
    other.trackers[0].load_state_dict(saved)
    whole = lambda masks: SupportIndex(torch.ones(info.numel, dtype=torch.bool), info.numels)  # noqa: E731
    assert other.trackers[0].decide(info, "cpu", whole)[0].mode == TRACKING
