"""The packing floor's device path (``gcomp.kernels.forced``, on CPU tensors): supports pack and unpack bit for bit
as on the CPU path in a few operations whatever their runs, filters or parameters (``gcomp.packing.positions``);
PacTrain's lanes are bitpack's words in a few operations whatever the width (``gcomp.packing.lanes``); the in-place
mask check waits for nothing (``gcomp.packing.mask_check``); one host read per step carries every flag
(``gcomp.packing.host_flags``)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from gcomp import kernels
from gcomp.collectives import bitpack
from gcomp.packing import lanes
from gcomp.packing.groups import GroupSupport
from gcomp.packing.host_flags import Slot, flag_set, receive_changed
from gcomp.packing.mask_check import mask_state, masks_differ
from gcomp.packing.state import BucketTrack
from gcomp.packing.support import SupportIndex, bucket_support
from gcomp.testing.ops import counting
from tests.packing import test_groups, test_support
from tests.packing.test_support import DTYPES, PROPERTY, _strides

BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


def _layout(params, g: torch.Generator, groups: bool) -> list:
    layout = []
    for size, channels_last, kind, *density in params:
        mask = test_groups._mask(size, kind, g) if groups else test_support._mask(size, kind, density[0], g)
        layout.append((torch.Size(size), _strides(size, channels_last), mask))
    return layout


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(BITS[t.dtype])


def _both_paths(support, numel: int, dtype: torch.dtype, g: torch.Generator) -> None:
    grad = torch.randn(numel, generator=g).to(dtype)
    grad[::7] = -0.0  # a negative zero keeps its sign through the unpack (bits, not values, are copied)
    cpu_out = support.gather(grad, torch.full((support.kept + 2,), 7.0, dtype=dtype))
    cpu_back = support.scatter(cpu_out, torch.full((numel,), float("nan"), dtype=dtype))
    with kernels.forced():
        dev_out = support.gather(grad, torch.full((support.kept + 2,), 7.0, dtype=dtype))
        dev_back = support.scatter(dev_out, torch.full((numel,), float("nan"), dtype=dtype))
    assert torch.equal(_bits(dev_out), _bits(cpu_out)) and torch.equal(_bits(dev_back), _bits(cpu_back))


@PROPERTY
@given(params=st.lists(test_support.parameters(), min_size=1, max_size=5), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**31 - 1))
def test_an_entry_support_packs_alike_on_both_paths(params, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    layout = _layout(params, g, groups=False)
    numel = sum(size.numel() for size, _, _ in layout)
    support = SupportIndex(bucket_support(layout, numel), tuple(size.numel() for size, _, _ in layout), 16)
    _both_paths(support, numel, dtype, g)


@PROPERTY
@given(params=st.lists(test_groups.parameters(), min_size=1, max_size=5), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**31 - 1))
def test_a_group_support_packs_alike_on_both_paths(params, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    layout = _layout(params, g, groups=True)
    numel = sum(size.numel() for size, _, _ in layout)
    _both_paths(GroupSupport(layout, numel), numel, dtype, g)


def _count(support, numel: int) -> int:
    bucket, out = torch.randn(numel), torch.empty(support.kept)
    with kernels.forced():
        support.gather(bucket, out)  # the index is made at the first call
        with counting() as counter:
            support.scatter(support.gather(bucket, out), bucket)
    assert not counter.syncs
    return sum(counter.ops.values())


def _supports(pieces: int) -> list:
    """``pieces`` long kept runs (slices on the CPU path), and ``pieces`` filter-pruned parameters."""
    runs = torch.arange(pieces * 600) // 300 % 2 == 0  # kept runs of 300 entries
    mask = torch.zeros(4, 6)
    mask[[0, 2]] = 1
    return [(SupportIndex(runs, (runs.numel(),)), runs.numel()),
            (GroupSupport([(torch.Size([4, 6]), (6, 1), mask)] * pieces, 24 * pieces), 24 * pieces)]


def test_the_device_path_packs_in_operations_that_do_not_grow():
    """A few operations (one index_select, one zero_, one index_add_, views), the same for 2 pieces or 40, and no
    host synchronisation."""
    for (few, n_few), (many, n_many) in zip(_supports(2), _supports(40)):
        assert _count(many, n_many) == _count(few, n_few) <= 10


@PROPERTY
@given(bits=st.integers(1, 21), n=st.integers(0, 300), seed=st.integers(0, 2**31 - 1))
def test_lanes_are_bitpacks_words_on_the_device_path(bits, n, seed):
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 1 << bits, (n,), generator=g, dtype=torch.int64).to(
        torch.uint8 if bits <= 8 else torch.int64)
    words = bitpack.pack(values, bits)
    with kernels.forced():
        assert torch.equal(lanes.pack(values, bits), words)
        summed = words * 3  # a SUM over 3 ranks of the same words: fields may use the sign bit
        assert torch.equal(lanes.unpack(summed, n, bits), bitpack.unpack(summed, n, bits))
        out = torch.full((words.numel() * bitpack.fields_per_word(bits) + 1,), -1.0)
        assert torch.equal(lanes.unpack(words, n, bits, out=out), values.to(torch.float32))


def test_lanes_take_the_same_few_operations_whatever_the_width_and_length():
    """bitpack takes a pass per field of a word (up to 64) and, for 1-bit fields, a pass per 64 K bytes."""
    counts = set()
    for bits, n in [(1, 1 << 22), (3, 21 << 14), (12, 5 << 12), (2, 1 << 20)]:  # whole words
        values = torch.ones(n, dtype=torch.uint8)
        with kernels.forced():
            lanes.pack(values[:64], bits)  # its shifts are made once per width and device
        with kernels.forced(), counting() as counter:
            lanes.unpack(lanes.pack(values, bits), n, bits, out=torch.empty(n + 64))
        assert not counter.syncs
        counts.add(sum(counter.ops.values()))
    assert len(counts) == 1 and counts.pop() <= 16


def test_the_mask_check_waits_for_nothing_on_the_device_path():
    masks = [torch.ones(3, 4), torch.tensor([1.0, 0.0, 1.0])]
    with kernels.forced():
        frozen = mask_state(masks)
        assert frozen.dtype == torch.bool and frozen.numel() == 15
        with counting() as counter:
            unchanged = masks_differ(mask_state(masks, frozen), frozen)
            masks[1].data[1] = 1.0  # an edit through .data: _version stays
            edited = masks_differ(mask_state(masks, frozen), frozen)
        assert not counter.syncs and isinstance(edited, torch.Tensor)
        assert not bool(unchanged) and bool(edited)
    if kernels.forced_kind() is None:  # the CPU path (not under GCOMP_FORCE_DEVICE_PATH): a digest on the host
        digest = mask_state(masks)
        assert digest.dtype == torch.int64 and masks_differ(mask_state(masks, digest), digest) is False


def test_the_resync_flag_rides_in_the_trackers_copy_and_is_read_once():
    """A one-round step's resync flag, left in the carry as a tensor, goes to the host in the tracker's copy of
    its flags; both readers then share one ``tolist``."""
    track = BucketTrack()
    track.state.carry.resync = torch.tensor([1]) > 0
    receive_changed(track, torch.tensor([0.0]))
    assert isinstance(track.state.carry.resync, Slot) and track.pending.host.tolist() == [False, True, True]
    with counting() as counter:
        assert track.pending.values()[:2] == [False, True]
        assert flag_set(track.state.carry.resync)
    assert counter.syncs == {"tolist": 1}
    receive_changed(track, torch.tensor([2.0]))  # no resync pending: the two flags of before
    assert track.pending.host.tolist() == [True, True]
