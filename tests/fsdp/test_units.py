"""Single-process checks of the FSDP2 parts: the layout, PacTrain's shard support, and gcomp bench --fsdp's checks."""
from __future__ import annotations

import pytest
import torch

import gcomp

from gcomp.bench import fsdp as bench_fsdp
from gcomp.collectives import bitpack
from gcomp.sharding import ShardLayout
from gcomp.packing.shard_support import ShardSupport


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


def test_shard_support_packs_each_row_padded_to_the_longest():
    layout = _layout(rank=2)
    mask = torch.tensor([[1, 0], [1, 1], [0, 0], [1, 0], [0, 1]])
    support = ShardSupport(layout, [mask, None], "cpu")
    # rows: [a rows 0-1, b 0-1], [a rows 2-3, b 2-3], [a row 4 + padding, b padding]: kept 3+2, 1+2, 1+0
    assert support.counts == (5, 3, 1) and support.width == 5 and support.kept == 15
    x = torch.arange(1.0, 19.0)
    wire = torch.full((3, 6), 7.0)
    support.pack(x, wire)
    assert torch.equal(wire[:, :5], torch.tensor([[1., 3, 4, 5, 6], [9, 11, 12, 0, 0], [14, 0, 0, 0, 0]]))
    out = torch.full((6,), 9.0)
    support.unpack_own(torch.tensor([16.0, 0, 0, 0, 0, 0]), out)
    assert torch.equal(out, torch.tensor([0., 16, 0, 0, 0, 0]))  # row 2 keeps a[4][1] only
    assert torch.equal(support.scatter(support.gather(x, torch.empty(15)), torch.empty(18)),
                       x * layout.shard_major([mask, None], 1.0, 0.0, torch.float32, "cpu").reshape(-1))


def test_ternary_rows_take_each_parameter_whole_and_lay_its_codes_in_the_packed_rows():
    layout = _layout(rank=1)
    mask = torch.tensor([[1, 0], [1, 1], [0, 0], [1, 0], [0, 1]])
    support = ShardSupport(layout, [mask, None], "cpu")
    rows = support.ternary
    x = torch.arange(1.0, 19.0)
    # the values: a's kept entries in a's own order (rows 0-1, 2-3, 4 of it), then b's 4 entries: DDP's segments
    values = rows.values.gather(x, torch.empty(rows.values.kept))
    assert torch.equal(values, torch.tensor([1., 3, 4, 9, 14, 5, 6, 11, 12]))
    assert rows.values.segments == (5, 4) and rows.own.segments == (1, 2) and rows.own.kept == 3
    # 3 ranks: 3-bit fields, 21 per word; K = 5 codes per row fit one word
    assert (rows.bits, rows.words, rows.fields) == (3, 1, 21)
    codes = torch.tensor([1, 2, 0, 2, 1, 0, 1, 2, 2], dtype=torch.uint8)  # one per value
    fields = torch.zeros(3, rows.fields, dtype=torch.uint8)
    words = rows.rows(torch.cat([codes, torch.zeros(12, dtype=torch.uint8)]), fields)
    # each row in ShardSupport's packed order (its own a-entries, then its b-entries), zero-padded
    expected = torch.zeros(3, 21, dtype=torch.int64)
    expected[0, :5] = torch.tensor([1, 2, 0, 0, 1])  # a[0,0], a[1,0], a[1,1], b[0], b[1]
    expected[1, :3] = torch.tensor([2, 2, 2])  # a[3,0], b[2], b[3]
    expected[2, :1] = torch.tensor([1])  # a[4,1]
    assert torch.equal(bitpack.unpack(words.reshape(-1), 63, 3).view(3, 21), expected)
    # the rows the lanes decode: this rank's, in the order unpack_own writes
    out = torch.zeros(6)
    support.unpack_own(torch.tensor([7.0, 8, 9]), out)
    assert torch.equal(out, torch.tensor([0., 0, 7, 0, 8, 9]))  # row 1 keeps a[3,0], b[2], b[3]


def test_bench_fsdp_accepts_its_defaults_and_ternary_and_refuses_what_cannot_run():
    bench_fsdp.check_methods(list(bench_fsdp.DEFAULT_METHODS))
    bench_fsdp.check_methods(["pactrain:ternary=true", "pactrain:ternary=true,rounds=2"])  # refused before
    for text, words in (("torch:fp16", "DDP hook"), ("topk", "cannot serve FSDP2")):
        with pytest.raises(ValueError, match=words):
            bench_fsdp.check_methods([text])


class _Recorder:
    """A method whose reduce-scatter records what it is handed and returns this rank's row of it."""

    def __init__(self, lossless: bool):
        self.lossless, self.seen = lossless, None

    def reduce_scatter(self, output, input, layout, group, stats):
        self.seen = input.clone()
        output.copy_(input.view(layout.world, -1)[layout.rank])


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


def test_pactrain_rows_refuse_group_granularity_and_decide_on_the_compressors_own_tracker():
    """The row strategy swaps no tracker in: it decides on the compressor's own ``MaskTracker`` (which its
    ``state_dict`` saves), building each layout's ``ShardSupport`` through ``decide``'s builder."""
    from gcomp.collectives.chained import ChainedAllreduceCommunicator
    from gcomp.compressors.pactrain import PacTrainCompressor
    from gcomp.compressors.pactrain_rows import PacTrainRows
    from gcomp.packing.tracker import MaskTracker

    grouped = gcomp.Method(PacTrainCompressor(granularity="groups"), gcomp.NoMemory(), ChainedAllreduceCommunicator())
    with pytest.raises(ValueError, match="granularity='groups' is not supported"):
        PacTrainRows().check(grouped)
    method = gcomp.create("pactrain", stable_steps=3, dense_above=0.5, check_every=4)
    tracker = method.compressor.tracker
    layout = _layout(world=3, rank=1)
    payload = method.row_strategy.compress(method.compressor, torch.ones(layout.numel), layout)
    assert method.compressor.tracker is tracker and type(tracker) is MaskTracker
    assert list(tracker.tracks) == [layout.params.key] and payload.tensors[0].shape == (3, layout.shard_numel)
    assert (tracker.stable_steps, tracker.dense_above, tracker.check_every) == (3, 0.5, 4)
