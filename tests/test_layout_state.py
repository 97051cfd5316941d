"""``gcomp.core.LayoutState``: state laid out like a bucket that follows its parameters through layout changes and
checkpoints, for every slot at once (ResidualMemory and a compressor's ``Traits.slots`` build on it)."""
from __future__ import annotations

import pytest
import torch

from gcomp import BucketInfo
from gcomp.core import LayoutState

A = BucketInfo.from_layout(0, torch.float32, ["a", "b"], [3, 2])
SPLIT = [BucketInfo.from_layout(0, torch.float32, ["b"], [2]), BucketInfo.from_layout(1, torch.float32, ["a"], [3])]


def _filled() -> LayoutState:
    state = LayoutState(("momentum", "velocity"), owner="test")
    slots = state.get(A, torch.zeros(5))
    slots["momentum"][:5] = torch.arange(5.0)
    slots["velocity"][:5] = -torch.arange(5.0)
    return state


def test_nothing_known_is_none_for_find_and_zeros_for_get():
    state = LayoutState(("residuals",))
    assert state.find(A, torch.zeros(5)) is None
    slots = state.get(A, torch.zeros(5, dtype=torch.float64))
    assert set(slots) == {"residuals"} and torch.equal(slots["residuals"], torch.zeros(5, dtype=torch.float64))
    assert state.find(A, torch.zeros(5)) is slots  # kept for the layout from now on


@pytest.mark.parametrize("via_checkpoint", [False, True], ids=["live", "checkpoint"])
def test_every_slot_moves_to_a_new_layout_parameter_by_parameter(via_checkpoint):
    state = _filled()
    if via_checkpoint:
        saved = state.state_dict()
        assert set(saved) == {"momentum", "velocity"} and set(saved["momentum"]) == {"a", "b"}
        state = LayoutState(("momentum", "velocity"))
        state.load_state_dict(saved)
    b, a = (state.get(info, torch.zeros(info.numel)) for info in SPLIT)
    assert torch.equal(b["momentum"], torch.tensor([3.0, 4.0])) and torch.equal(b["velocity"], -b["momentum"])
    assert torch.equal(a["momentum"], torch.tensor([0.0, 1.0, 2.0]))
    assert torch.equal(state.state_dict()["velocity"]["a"], torch.tensor([0.0, -1.0, -2.0]))


def test_a_layout_with_a_new_parameter_starts_it_at_zero():
    state = _filled()
    grown = BucketInfo.from_layout(0, torch.float32, ["c", "a"], [4, 3])
    slots = state.find(grown, torch.zeros(7))
    assert torch.equal(slots["momentum"], torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 2.0]))
    assert set(state.state_dict()["momentum"]) == {"a", "b", "c"}  # b waits, unplaced, in the checkpoint


def test_put_replaces_the_layouts_tensors():
    state = _filled()
    state.put(A, {"momentum": torch.ones(5), "velocity": torch.full((5,), 2.0)})
    assert torch.equal(state.state_dict()["velocity"]["b"], torch.full((2,), 2.0))


def test_a_piece_of_the_wrong_size_is_a_clear_error():
    state = LayoutState(("residuals",), owner="ResidualMemory")
    state.load_state_dict({"residuals": {"a": torch.zeros(4)}})
    with pytest.raises(ValueError, match="ResidualMemory: the residuals of parameter 'a' hold 4 elements, "
                                         "the bucket holds 3"):
        state.find(A, torch.zeros(5))
