"""pactrain's supports (``gcomp.compressors.pactrain.support``): property tests over random buckets, and FSDP2's rows.

A bucket holds several parameters, some unpruned, some fully pruned, 4-D ones in channels_last too (DDP lays their
gradients in memory order); each simulated rank's gradient is packed as the codec packs it (one ``index_select``),
the packed vectors are summed as an all-reduce would, and the sum scattered back (``codec._scatter``) must be the
dense sum on the support and exactly 0 elsewhere. Entries (``pactrain``) keep exactly the masks' entries, in bucket
order; groups (``prunex``) whole filters and channels, each parameter's in logical order.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gcomp.collectives import bitpack
from gcomp.compressors.pactrain.codec import _scatter
from gcomp.compressors.pactrain.support import ShardSupport, bucket_support, group_dim
from gcomp.pruning.masks import positions_digest
from gcomp.sharding import ShardLayout

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


@st.composite
def parameters(draw):
    """``(size, channels_last, mask kind)`` of one parameter."""
    kind = draw(st.sampled_from(["1d", "2d", "4d", "4d_channels_last"]))
    if kind == "1d":
        size = (draw(st.integers(1, 700)),)
    elif kind == "2d":
        size = (draw(st.integers(1, 24)), draw(st.integers(1, 40)))
    else:
        size = tuple(draw(st.integers(1, 6)) for _ in range(4))
    masks = ["none", "random", "runs", "pruned", "kept", "filters", "channels"]
    return size, kind == "4d_channels_last", draw(st.sampled_from(masks))


def _mask(size, kind: str, g: torch.Generator) -> torch.Tensor | None:
    n = torch.Size(size).numel()
    if kind == "none":
        return None
    if kind in ("filters", "channels"):
        dim = 1 if kind == "channels" and len(size) > 1 else 0
        shape = [1] * len(size)
        shape[dim] = -1
        return (torch.rand(size[dim], generator=g) < 0.5).view(shape).expand(size).float()
    if kind == "random":
        flat = torch.rand(n, generator=g) < 0.5
    elif kind == "runs":  # alternating kept and pruned runs of random lengths
        run_of = torch.repeat_interleave(torch.arange(n), torch.randint(1, 400, (n,), generator=g))[:n]
        flat = run_of % 2 == 0
    else:
        flat = torch.full((n,), kind == "kept")
    return flat.reshape(size).float()


def _strides(size, channels_last: bool) -> tuple[int, ...]:
    like = torch.empty(size)
    return (like.contiguous(memory_format=torch.channels_last) if channels_last else like).stride()


def _memory_order(mask: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """The mask's entries in the order the parameter's memory holds them (NHWC for channels_last)."""
    return (mask.permute(0, 2, 3, 1) if channels_last else mask).reshape(-1) != 0


@PROPERTY
@given(params=st.lists(parameters(), min_size=1, max_size=5), world=st.integers(1, 4), groups=st.booleans(),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1))
def test_packed_sum_scattered_back_is_the_dense_sum_on_the_support(params, world, groups, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    layout, masked, exact = [], [], []
    for size, channels_last, kind in params:
        mask = _mask(size, kind, g)
        layout.append((torch.Size(size), _strides(size, channels_last), mask))
        n = torch.Size(size).numel()
        masked.append(torch.ones(n, dtype=torch.bool) if mask is None else _memory_order(mask, channels_last))
        exact.append(torch.full((n,), not groups or kind not in ("random", "runs")))
    masked, exact = torch.cat(masked), torch.cat(exact)
    numel = masked.numel()
    numels = [size.numel() for size, _, _ in layout]

    support = bucket_support(layout, numel, "cpu", groups)
    kept = torch.zeros(numel, dtype=torch.bool).index_fill_(0, support.positions.long(), True)
    assert support.numel == numel and support.kept == int(kept.sum()) == support.positions.numel()
    assert support.positions.dtype == torch.int32 and support.positions.unique().numel() == support.kept
    assert torch.equal(kept[exact], masked[exact]) and (kept | ~masked).all()  # groups cover unstructured masks
    assert support.segments == tuple(int(s.sum()) for s in kept.split(numels))
    assert torch.equal(support.digest, positions_digest(kept.nonzero()))
    if not groups:
        assert torch.equal(support.positions.long(), kept.nonzero().reshape(-1))  # bucket order

    grads = [torch.randn(numel, generator=g).to(dtype) for _ in range(world)]
    grads[0][::7] = -0.0  # a negative zero keeps its sign through the scatter (bits are copied)
    packed = [grad.index_select(0, support.positions) for grad in grads]
    for grad, p in zip(grads, packed):  # round trip of one rank: its kept entries back, exact zeros elsewhere
        back = _scatter(p, support.positions, numel)
        assert torch.equal(back.view(BITS[dtype]), torch.where(kept, grad, torch.zeros((), dtype=dtype)).view(BITS[dtype]))
    total, dense = packed[0].clone(), grads[0].clone()  # the same additions, in the same rank order
    for p, grad in zip(packed[1:], grads[1:]):
        total += p
        dense += grad
    back = _scatter(total, support.positions, numel)
    assert torch.equal(back[kept], dense[kept]) and (back[~kept] == 0).all()


def test_channels_last_mask_lands_in_memory_order():
    """One kept entry at logical [n=0, c=1, h=0, w=1] of a (2, 3, 2, 2) channels_last parameter sits at
    n*HWC + h*WC + w*C + c = 0 + 0 + 3 + 1 = 4 of its memory, after a 5-entry unpruned parameter."""
    mask = torch.zeros(2, 3, 2, 2)
    mask[0, 1, 0, 1] = 1
    size = torch.Size([2, 3, 2, 2])
    support = bucket_support([(torch.Size([5]), (1,), None), (size, _strides(size, True), mask)], 5 + 24, "cpu")
    assert support.positions.tolist() == [0, 1, 2, 3, 4, 5 + 4] and support.segments == (5, 1)


def test_kept_filters_of_a_contiguous_weight_are_runs_of_the_bucket_in_order():
    """Filters 1 and 3 of a (4, 2, 3, 3) conv weight after a 5-entry bias: entries 5+18..5+36 and 5+54..5+72."""
    mask = torch.zeros(4, 2, 3, 3)
    mask[[1, 3]] = 1
    size = mask.size()
    support = bucket_support([(torch.Size([5]), (1,), None), (size, _strides(size, False), mask)], 5 + 72, "cpu",
                             groups=True)
    expected = torch.cat([torch.arange(5), torch.arange(23, 41), torch.arange(59, 77)])
    assert torch.equal(support.positions.long(), expected)


def test_fully_pruned_buckets_and_bad_layouts():
    pruned = bucket_support([(torch.Size([4]), (1,), torch.zeros(4)), (torch.Size([6]), (1,), torch.zeros(6))], 10,
                            "cpu")
    assert pruned.kept == 0 and pruned.segments == (0, 0)
    assert (_scatter(torch.empty(0), pruned.positions, 10) == 0).all()
    with pytest.raises(ValueError, match="cover"):
        bucket_support([(torch.Size([3]), (1,), None)], 4, "cpu")


def test_group_dim_picks_the_dimension_that_sends_least():
    filters = torch.zeros(4, 6)
    filters[2] = 1
    assert group_dim(filters)[0] == 0
    channels = torch.zeros(4, 6)
    channels[:, 5] = 1
    assert group_dim(channels)[0] == 1
    assert group_dim(torch.ones(3, 3))[0] == 0  # a tie: filters


# --- FSDP2's rows --------------------------------------------------------------------------------------------------

def _layout(world=3, rank=1):
    return ShardLayout(0, ("a", "b"), (torch.Size([5, 2]), torch.Size([4])), world, rank, torch.float32)


MASK = torch.tensor([[1, 0], [1, 1], [0, 0], [1, 0], [0, 1]])


def test_shard_support_packs_each_row_padded_to_the_longest():
    layout = _layout(rank=2)
    support = ShardSupport(layout, [MASK, None], "cpu")
    # rows: [a rows 0-1, b 0-1], [a rows 2-3, b 2-3], [a row 4 + padding, b padding]: kept 3+2, 1+2, 1+0
    assert support.valid.sum(1).tolist() == [5, 3, 1] and support.width == 5 and support.kept == 15
    x = torch.arange(1.0, 19.0).view(3, -1)
    packed = torch.gather(x, 1, support.index).masked_fill_(~support.valid, 0)
    assert torch.equal(packed, torch.tensor([[1., 3, 4, 5, 6], [9, 11, 12, 0, 0], [14, 0, 0, 0, 0]]))
    assert support.own.tolist() == [1]  # row 2 keeps a[4][1] only
    assert torch.equal(_scatter(torch.tensor([16.0]), support.own, 6), torch.tensor([0., 16, 0, 0, 0, 0]))


def test_ternary_rows_take_each_parameter_whole_and_lay_its_codes_in_the_packed_rows():
    layout = _layout(rank=1)
    rows = ShardSupport(layout, [MASK, None], "cpu").ternary
    x = torch.arange(1.0, 19.0)
    # the values: a's kept entries in a's own order (rows 0-1, 2-3, 4 of it), then b's 4 entries: DDP's segments
    assert torch.equal(x.index_select(0, rows.positions), torch.tensor([1., 3, 4, 9, 14, 5, 6, 11, 12]))
    assert rows.segments == (5, 4) and rows.own_segments == (1, 2) and rows.own.numel() == 3
    # 3 ranks: 3-bit fields, 21 per word; K = 5 codes per row fit one word
    assert (rows.bits, rows.words, rows.fields) == (3, 1, 21)
    codes = torch.tensor([1, 2, 0, 2, 1, 0, 1, 2, 2], dtype=torch.uint8)  # one per value
    fields = torch.zeros(3 * rows.fields, dtype=torch.uint8).index_copy_(0, rows.dest, codes)
    # each row in ShardSupport's packed order (its own a-entries, then its b-entries), zero-padded
    expected = torch.zeros(3, 21, dtype=torch.uint8)
    expected[0, :5] = torch.tensor([1, 2, 0, 0, 1])  # a[0,0], a[1,0], a[1,1], b[0], b[1]
    expected[1, :3] = torch.tensor([2, 2, 2])  # a[3,0], b[2], b[3]
    expected[2, :1] = torch.tensor([1])  # a[4,1]
    assert torch.equal(fields.view(3, 21), expected)
    words = bitpack.pack(fields, rows.bits).view(3, rows.words)
    assert torch.equal(bitpack.unpack(words.reshape(-1), 63, 3).view(3, 21), expected.long())
    # this rank's row as its decode writes it: row 1 keeps a[3,0], b[2], b[3]
    assert torch.equal(_scatter(torch.tensor([7.0, 8, 9]), rows.own, 6), torch.tensor([0., 0, 7, 0, 8, 9]))
