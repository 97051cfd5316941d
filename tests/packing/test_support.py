"""A bucket's support and its packing index (``gcomp.packing.support``): property tests over random buckets.

A bucket holds several parameters, some unpruned, some fully pruned, 4-D ones in channels_last too (DDP lays
their gradients in memory order); each simulated rank's gradient is packed, the packed vectors are summed as
an all-reduce would, and the sum scattered back must be the dense sum on the support and exactly 0 elsewhere.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gcomp.kernels import forced_kind
from gcomp.pruning.masks import positions_digest
from gcomp.packing.support import SupportIndex, bucket_support

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# the whole process on the device path (GCOMP_FORCE_DEVICE_PATH): a support then also holds the device path's
# index of every kept position (gcomp.packing.positions), 4 bytes per kept entry
DEVICE_PATH = forced_kind() is not None


def device_index_bytes(kept: int) -> int:
    """What the device path's index adds to ``index_bytes``: nothing on the CPU path."""
    return 4 * kept if DEVICE_PATH else 0


@st.composite
def parameters(draw):
    """``(size, channels_last, mask kind, density)`` of one parameter."""
    kind = draw(st.sampled_from(["1d", "2d", "4d", "4d_channels_last"]))
    if kind == "1d":
        size = (draw(st.integers(1, 700)),)
    elif kind == "2d":
        size = (draw(st.integers(1, 24)), draw(st.integers(1, 40)))
    else:
        size = tuple(draw(st.integers(1, 6)) for _ in range(4))
    mask = draw(st.sampled_from(["none", "random", "runs", "pruned", "kept"]))
    return size, kind == "4d_channels_last", mask, draw(st.sampled_from([0.1, 0.5, 0.9]))


def _mask(size, kind: str, density: float, g: torch.Generator) -> torch.Tensor | None:
    n = torch.Size(size).numel()
    if kind == "none":
        return None
    if kind == "random":
        flat = torch.rand(n, generator=g) < density
    elif kind == "runs":  # alternating kept and pruned runs of random lengths: long runs become slices
        lengths = torch.randint(1, 400, (n,), generator=g)
        run_of = torch.repeat_interleave(torch.arange(n), lengths)[:n]
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


def _pieces_are_a_partition(index: SupportIndex, support: torch.Tensor, min_run: int) -> None:
    """Pieces cover the bucket in order without overlap; slices are kept runs of at least ``min_run``; scattered
    pieces list exactly the kept positions of their region and hold no such run; packed offsets follow on."""
    cursor = at = 0
    for piece in index.pieces:
        assert piece.start == cursor and piece.stop >= piece.start and piece.at == at
        region = support[piece.start:piece.stop]
        positions = getattr(piece, "positions", None)
        if positions is None:  # a slice
            assert region.all() and piece.stop - piece.start >= min_run
            at += piece.stop - piece.start
        else:
            assert positions.dtype == torch.int32
            assert torch.equal(positions.long(), region.nonzero().reshape(-1) + piece.start)
            edges = torch.diff(torch.nn.functional.pad(region.to(torch.int8), (1, 1)))
            runs = (edges == -1).nonzero() - (edges == 1).nonzero()
            assert runs.numel() == 0 or runs.max() < min_run
            at += positions.numel()
        cursor = piece.stop
    assert cursor == support.numel() and at == index.kept


@PROPERTY
@given(params=st.lists(parameters(), min_size=1, max_size=5), world=st.integers(1, 4),
       dtype=st.sampled_from(DTYPES), min_run=st.sampled_from([1, 3, 16, 256]), seed=st.integers(0, 2**31 - 1))
def test_packed_sum_scattered_back_is_the_dense_sum_on_the_support(params, world, dtype, min_run, seed):
    g = torch.Generator().manual_seed(seed)
    layout, expected_support = [], []
    for size, channels_last, kind, density in params:
        mask = _mask(size, kind, density, g)
        layout.append((torch.Size(size), _strides(size, channels_last), mask))
        n = torch.Size(size).numel()
        expected_support.append(torch.ones(n, dtype=torch.bool) if mask is None else _memory_order(mask, channels_last))
    expected_support = torch.cat(expected_support)
    numel = expected_support.numel()
    numels = tuple(size.numel() for size, _, _ in layout)

    support = bucket_support(layout, numel)
    assert torch.equal(support, expected_support)
    index = SupportIndex(support, numels, min_run)
    assert index.numel == numel and index.kept == int(support.sum())
    assert index.segments == tuple(int(s.sum()) for s in support.split(list(numels)))
    assert torch.equal(index.digest, positions_digest(support.nonzero()))
    _pieces_are_a_partition(index, support, min_run)
    pieces_bytes = 4 * sum(p.positions.numel() for p in index.pieces if hasattr(p, "positions"))
    assert index.index_bytes == pieces_bytes + device_index_bytes(index.kept)
    assert pieces_bytes <= 4 * index.kept

    # each rank's gradient, with values off the support too: packing must drop them
    grads = [torch.randn(numel, generator=g).to(dtype) for _ in range(world)]
    packed = []
    for grad in grads:
        original = grad.clone()
        out = torch.full((index.kept + 3,), 7.0, dtype=dtype)  # longer than needed: the tail stays as it was
        assert index.gather(grad, out) is out
        assert torch.equal(grad, original)
        assert torch.equal(out[:index.kept], grad[support]) and (out[index.kept:] == 7).all()
        packed.append(out[:index.kept])
        # round trip of one rank: its kept entries back in place, exact zeros elsewhere
        bucket = torch.full((numel,), float("nan"), dtype=dtype)
        assert index.scatter(out, bucket) is bucket
        assert torch.equal(bucket, torch.where(support, grad, torch.zeros((), dtype=dtype)))

    total, dense = packed[0].clone(), grads[0].clone()  # the same additions, in the same rank order
    for p, grad in zip(packed[1:], grads[1:]):
        total += p
        dense += grad
    bucket = torch.full((numel,), float("nan"), dtype=dtype)
    index.scatter(total, bucket)
    assert torch.equal(bucket[support], dense[support])
    assert (bucket[~support] == 0).all()


def test_channels_last_mask_lands_in_memory_order():
    """One kept entry at logical [n=0, c=1, h=0, w=1] of a (2, 3, 2, 2) channels_last parameter sits at
    n*HWC + h*WC + w*C + c = 0 + 0 + 3 + 1 = 4 of its memory, after an 5-entry unpruned parameter."""
    mask = torch.zeros(2, 3, 2, 2)
    mask[0, 1, 0, 1] = 1
    size = torch.Size([2, 3, 2, 2])
    support = bucket_support([(torch.Size([5]), (1,), None), (size, _strides(size, True), mask)], 5 + 24)
    assert support.nonzero().reshape(-1).tolist() == [0, 1, 2, 3, 4, 5 + 4]


def test_fully_pruned_and_empty_buckets():
    everything_pruned = SupportIndex(torch.zeros(10, dtype=torch.bool), (4, 6))
    assert everything_pruned.kept == 0 and everything_pruned.segments == (0, 0)
    bucket = torch.ones(10)
    everything_pruned.scatter(torch.empty(0), bucket)
    assert (bucket == 0).all()
    whole = SupportIndex(torch.ones(600, dtype=torch.bool), (600,))
    assert len(whole.pieces) == 1  # one slice, no index (on the CPU path)
    assert whole.index_bytes == device_index_bytes(600)


def test_bad_supports_are_clear_errors():
    with pytest.raises(ValueError, match="flat bool"):
        SupportIndex(torch.ones(4), (4,))
    with pytest.raises(ValueError, match="flat bool"):
        SupportIndex(torch.ones(4, dtype=torch.bool), (3,))
    with pytest.raises(ValueError, match="cover"):
        bucket_support([(torch.Size([3]), (1,), None)], 4)
