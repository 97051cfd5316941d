"""Single-process checks of the FSDP2 parts: the layout, pactrain on rows, and gcomp bench --fsdp's checks
(pactrain's shard support: tests/compressors/test_pactrain_support.py)."""
from __future__ import annotations

import pytest
import torch

import gcomp

from gcomp.bench import fsdp as bench_fsdp
from gcomp.sharding import ShardLayout


def _layout(world=3, rank=1):
    return ShardLayout(0, ("a", "b"), (torch.Size([5, 2]), torch.Size([4])), world, rank, torch.float32)


def test_layout_is_fsdps_shard_major_order():
    layout = _layout()
    assert layout.chunks == (4, 2) and layout.numel == 18
    a, b = torch.arange(10.0).view(5, 2), torch.arange(100.0, 104.0)
    rows = layout.shard_major([a, b], 0.0, -1.0, torch.float32, "cpu")
    # FSDP's chunk_cat: dim 0 padded to 6 rows of a and 6 entries of b, then 3 chunks, row-major
    expected = torch.cat([torch.cat([a, torch.full((1, 2), -1.0)]).view(3, 4),
                          torch.cat([b, torch.full((2,), -1.0)]).view(3, 2)], dim=1)
    assert torch.equal(rows, expected)
    assert layout.pieces.names[:3] == ("a[0]", "b[0]", "a[1]") and sum(layout.pieces.numels) == 18


def test_bench_fsdp_accepts_its_defaults_and_ternary_and_refuses_what_cannot_run():
    bench_fsdp.check_methods(list(bench_fsdp.DEFAULT_METHODS))
    bench_fsdp.check_methods(["pactrain:ternary=true", "pactrain:ternary=true,rounds=2"])  # refused before
    for text, words in (("torch:fp16", "DDP hook"), ("topk", "cannot serve FSDP2")):
        with pytest.raises(ValueError, match=words):
            bench_fsdp.check_methods([text])


class _Recorder:
    """A method that records the rows it is handed and returns this rank's row of them."""

    def __init__(self, lossless: bool):
        self.lossless, self.seen = lossless, None

    def reduce(self, buffer, layout, group, stats):
        self.seen = buffer.clone()
        done = torch.futures.Future()
        done.set_result(buffer.view(layout.world, -1)[layout.rank].clone())
        return done


def test_a_lossy_method_encodes_the_mean_and_a_lossless_one_divides_the_sum():
    """As DDP's hook for lossy methods (16-bit sums do not overflow, residuals and carried scales are in the mean's
    units); after the sum, as FSDP itself, for lossless ones (bit for bit FSDP2's own reduce-scatter)."""
    from gcomp.fsdp import FSDPState

    layout = _layout(world=2, rank=0)
    for lossless in (False, True):
        state = object.__new__(FSDPState)  # no process group: the division and the call, alone
        state.method, state._layouts, state._backward, state.iteration = _Recorder(lossless), set(), None, 0
        state.stats = {"steps": 0, "buckets": 0, "bytes_dense": 0, "layouts": 0}
        x, out = torch.arange(1.0, 1.0 + layout.numel), torch.empty(layout.shard_numel)
        state.reduce_scatter(layout, out, x.clone(), None, 4.0)
        assert torch.equal(state.method.seen, x if lossless else x / 4), lossless
        assert torch.equal(out, x.view(2, -1)[0] / 4)
    assert not gcomp.create("pactrain", ternary=True).lossless and gcomp.create("pactrain").lossless


def test_pactrain_refuses_group_granularity_and_decides_on_the_compressors_own_tracker():
    """Under FSDP2 the compressor's own ``MaskTracker`` (which its ``state_dict`` saves) decides on the layout's
    parameters, building a ``ShardSupport``; whole filters and channels (prunex's packing) do not serve FSDP2."""
    from gcomp.collectives.reduce import ChainedAllreduceCommunicator
    from gcomp.compressors.pactrain import MaskTracker, PacTrainCompressor, PacTrainMethod

    grouped = PacTrainMethod(PacTrainCompressor(granularity="groups"), gcomp.NoMemory(), ChainedAllreduceCommunicator())
    assert not grouped.serves_fsdp and gcomp.create("pactrain").serves_fsdp
    method = gcomp.create("pactrain", stable_steps=3, dense_above=0.5, check_every=4)
    tracker = method.compressor.tracker
    layout = _layout(world=3, rank=1)
    payload, _ = method.compressor.encode(torch.ones(layout.numel), {}, layout)
    assert method.compressor.tracker is tracker and type(tracker) is MaskTracker
    assert list(tracker.tracks) == [layout.params.key] and payload.tensors[0].shape == (3, layout.shard_numel)
    assert payload.rows and payload.whole == (1,)  # the tracking flags go whole, by MAX
    assert (tracker.stable_steps, tracker.dense_above, tracker.check_every) == (3, 0.5, 4)
