"""``gcomp.bucket_state.BucketState``: state laid out like a bucket that follows its parameters through layout
changes and checkpoints, for every slot at once (ResidualMemory, DGC and Signum build on it; their own tests
check them through it: tests/test_memory.py, tests/compressors/test_dgc.py, test_sign.py)."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch

from gcomp import BucketInfo
from gcomp.bucket_state import BucketState

A = BucketInfo.from_layout(0, torch.float32, ["a", "b"], [3, 2])
SPLIT = [BucketInfo.from_layout(0, torch.float32, ["b"], [2]), BucketInfo.from_layout(1, torch.float32, ["a"], [3])]


def _filled(spare: int = 0) -> BucketState:
    state = BucketState(("momentum", "velocity"), spare=spare, owner="test")
    slots = state.get(A, torch.zeros(5))
    slots["momentum"][:5] = torch.arange(5.0)
    slots["velocity"][:5] = -torch.arange(5.0)
    return state


def test_nothing_known_is_none_for_find_and_zeros_for_get():
    state = BucketState(("residuals",))
    assert state.find(A, torch.zeros(5)) is None
    slots = state.get(A, torch.zeros(5, dtype=torch.float64))
    assert set(slots) == {"residuals"} and torch.equal(slots["residuals"], torch.zeros(5, dtype=torch.float64))
    assert state.find(A, torch.zeros(5)) is slots  # kept for the layout from now on


@pytest.mark.parametrize("via_checkpoint", [False, True], ids=["live", "checkpoint"])
def test_every_slot_moves_to_a_new_layout_parameter_by_parameter(via_checkpoint):
    state = _filled(spare=1)
    if via_checkpoint:
        saved = state.state_dict()
        assert set(saved) == {"momentum", "velocity"} and set(saved["momentum"]) == {"a", "b"}
        state = BucketState(("momentum", "velocity"), spare=1)
        state.load_state_dict(saved)
    b, a = (state.get(info, torch.zeros(info.numel)) for info in SPLIT)
    assert torch.equal(b["momentum"], torch.tensor([3.0, 4.0, 0.0])) and torch.equal(b["velocity"][:2], -b["momentum"][:2])
    assert torch.equal(a["momentum"], torch.tensor([0.0, 1.0, 2.0, 0.0]))  # the spare entry starts at zero
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
    state = BucketState(("residuals",), owner="ResidualMemory")
    state.load_state_dict({"residuals": {"a": torch.zeros(4)}})
    with pytest.raises(ValueError, match="ResidualMemory: the residuals of parameter 'a' hold 4 elements, "
                                         "the bucket holds 3"):
        state.find(A, torch.zeros(5))


def _stress_copies(holder, fill) -> None:
    """Deep-copy ``holder`` over and over while another thread keeps adding buffers to it, as a decode on the
    backend's threads does while the main thread copies a method (the contract suite's twin)."""
    import copy
    import threading

    done = threading.Event()

    def add():
        i = 0
        while not done.is_set():
            fill(i)
            i += 1

    worker = threading.Thread(target=add)
    worker.start()
    try:
        for _ in range(300):
            copy.deepcopy(holder)
    finally:
        done.set()
        worker.join()


def test_a_scratch_copies_empty_and_safely_while_another_thread_takes():
    from gcomp.bucket_state import Scratch

    scratch = Scratch(slots=2)
    info = BucketInfo.from_layout(0, torch.float32, ["w"], [8])
    held = scratch.take(info, 8, torch.float32, torch.device("cpu"))
    twin = copy.deepcopy(scratch)
    assert twin.slots == 2 and twin._kept == {} and not twin.keeps(info, held)
    assert pickle.loads(pickle.dumps(scratch))._kept == {}

    def fill(i):
        layout = BucketInfo.from_layout(i, torch.float32, [f"p{i}"], [4])
        scratch.take(layout, 4, torch.float32, torch.device("cpu"))

    _stress_copies({"scratch": scratch}, fill)


def test_the_quantisers_scratch_copies_empty_while_another_thread_fills_it():
    from gcomp.compressors.quantise import Scratch

    scratch = Scratch()
    scratch.get("b0", "draws", 4, torch.float32, torch.device("cpu"))
    assert copy.deepcopy(scratch)._buffers == {}
    _stress_copies({"scratch": scratch},
                   lambda i: scratch.get(f"b{i}", "draws", 4, torch.float32, torch.device("cpu")))
