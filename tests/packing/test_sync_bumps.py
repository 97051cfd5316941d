"""DDP's re-sending of the masks at every forward (an in-place copy on torch up to 2.12) is not an edit."""
from __future__ import annotations

import copy
import pickle

import torch
from torch import nn
from torch.nn.utils import prune

from gcomp import BucketInfo
from gcomp.packing.sync_bumps import SyncBumps
from gcomp.packing.tracker import MaskTracker


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


def _info(model) -> BucketInfo:
    params = dict(model.named_parameters())
    return BucketInfo.from_layout(0, torch.float32, params, [p.numel() for p in params.values()])


def test_a_broadcast_leaves_the_signature_and_an_edit_changes_it():
    model = _pruned()
    wrapper = BroadcastingWrapper(model)
    tracker = MaskTracker()
    tracker.watch(wrapper)
    tracker.bind(model, {})
    info = _info(model)
    before = tracker._signature(info)
    for _ in range(3):
        wrapper(torch.randn(2, 6))
    assert model[0].weight_mask._version > 1  # the copies did bump it
    assert tracker._signature(info) == before
    model[0].weight_mask.mul_(1)  # an edit in place, outside the broadcast
    assert tracker._signature(info) != before


def test_counts_only_what_the_wrapped_forward_added_and_stops_on_close():
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


def test_a_copy_watches_nothing():
    model = _pruned()
    bumps = SyncBumps()
    bumps.watch(BroadcastingWrapper(model))
    for twin in (copy.deepcopy(bumps), pickle.loads(pickle.dumps(bumps))):
        assert twin.bumps == {} and twin._handles == []


def test_a_model_that_does_not_resend_its_buffers_gets_no_hooks():
    model = _pruned()
    wrapper = BroadcastingWrapper(model)
    wrapper.broadcast_buffers = False  # as DDP built with no_buffer_sync() reads
    bumps = SyncBumps()
    bumps.watch(wrapper)
    assert bumps._handles == [] and not wrapper._forward_pre_hooks and not model._forward_pre_hooks
