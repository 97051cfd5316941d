"""``gcomp.pruning.no_buffer_sync``: DDP built with it syncs no buffer at forward and warns about nothing, on
the torch installed (``forward_sync_buffers=False`` since torch 2.13); on a DDP without that option it falls
back to ``broadcast_buffers=False``. One rank, one gloo group in this process (a FileStore in tmp_path)."""
from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.nn.utils import prune

from gcomp.pruning import masks as ddp_options
from gcomp.pruning import no_buffer_sync


def _pruned_model() -> nn.Module:
    """A pruning mask and BatchNorm's running statistics: buffers DDP would broadcast at every forward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4))
    prune.l1_unstructured(model[0], "weight", amount=0.5)
    return model


def _build(group, **options) -> tuple[DistributedDataParallel, list[warnings.WarningMessage], list[int]]:
    """DDP with ``options``, the warnings its construction raised, and how often its forward synced buffers
    (DDP's own ``_sync_buffers``, counted) in one forward."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddp = DistributedDataParallel(_pruned_model(), process_group=group, **options)
    synced = []
    sync = ddp._sync_buffers
    ddp._sync_buffers = lambda: (synced.append(1), sync())[1]
    ddp(torch.randn(8, 6)).sum().backward()
    return ddp, caught, synced


def test_the_option_this_torch_has():
    parameters = inspect.signature(DistributedDataParallel.__init__).parameters
    expected = "forward_sync_buffers" if "forward_sync_buffers" in parameters else "broadcast_buffers"
    assert no_buffer_sync() == {expected: False}
    no_buffer_sync()[expected] = True  # a fresh dict each call: editing one changes no later caller's
    assert no_buffer_sync() == {expected: False}


def test_ddp_built_with_it_syncs_no_buffer_and_warns_nothing(group):
    ddp, caught, synced = _build(group, **no_buffer_sync())
    about_buffers = [f"{w.category.__name__}: {w.message}" for w in caught
                     if issubclass(w.category, (FutureWarning, DeprecationWarning)) and "buffers" in str(w.message)]
    assert not about_buffers, about_buffers
    assert ddp.will_sync_module_buffers() is False  # what DDP's forward asks (torch 2.13 and older alike)
    assert ddp.broadcast_buffers is False  # an alias of forward_sync_buffers on torch 2.13
    assert synced == []


def test_ddp_by_default_does_sync_buffers(group):
    """The control: the same model under DDP's defaults syncs its buffers before the forward."""
    ddp, _, synced = _build(group)
    assert ddp.will_sync_module_buffers() is True
    assert synced == [1]


def test_falls_back_to_broadcast_buffers_on_a_ddp_without_the_option(monkeypatch):
    class OldDDP:  # DistributedDataParallel's signature before torch 2.13, as far as buffers go
        def __init__(self, module, device_ids=None, output_device=None, dim=0, broadcast_buffers=True,
                     init_sync=True, process_group=None):
            pass

    ddp_options._has_forward_sync_buffers.cache_clear()
    monkeypatch.setattr(ddp_options, "DistributedDataParallel", OldDDP)
    try:
        assert no_buffer_sync() == {"broadcast_buffers": False}
    finally:
        ddp_options._has_forward_sync_buffers.cache_clear()
