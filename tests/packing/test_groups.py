"""The structured support of a bucket (``gcomp.packing.groups``): whole filters and channels, as prunex packs them.

Property tests over random buckets of unpruned, filter-pruned, channel-pruned, unstructured, fully pruned and
fully kept parameters, contiguous and channels_last: each simulated rank's gradient is packed, the packed
vectors summed as an all-reduce would, and the sum scattered back must be the dense sum on the support and
exactly 0 elsewhere. For structured masks the support is exactly the mask's; for unstructured ones it is the
smallest union of whole groups covering it.
"""
from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from gcomp.packing.groups import GroupSupport, group_dim
from gcomp.pruning.masks import positions_digest
from gcomp.packing.support import bucket_support
from tests.packing.test_support import DTYPES, PROPERTY, _memory_order, _strides, device_index_bytes

KINDS = ["none", "filters", "channels", "unstructured", "pruned", "kept"]


@st.composite
def parameters(draw):
    """``(size, channels_last, mask kind)`` of one parameter."""
    shape = draw(st.sampled_from(["1d", "2d", "4d", "4d_channels_last"]))
    if shape == "1d":
        size = (draw(st.integers(1, 60)),)
    elif shape == "2d":
        size = (draw(st.integers(1, 12)), draw(st.integers(1, 20)))
    else:
        size = tuple(draw(st.integers(1, 5)) for _ in range(4))
    return size, shape == "4d_channels_last", draw(st.sampled_from(KINDS))


def _mask(size, kind: str, g: torch.Generator) -> torch.Tensor | None:
    if kind == "none":
        return None
    if kind in ("pruned", "kept"):
        return torch.full(size, float(kind == "kept"))
    if kind == "unstructured":
        return (torch.rand(size, generator=g) < 0.5).float()
    dim = 1 if kind == "channels" and len(size) > 1 else 0
    groups = torch.rand(size[dim], generator=g) < 0.5
    shape = [1] * len(size)
    shape[dim] = -1
    return groups.view(shape).expand(size).float()


@PROPERTY
@given(params=st.lists(parameters(), min_size=1, max_size=5), world=st.integers(1, 4),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1))
def test_packed_sum_scattered_back_is_the_dense_sum_on_whole_groups(params, world, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    layout, mask_support, structured = [], [], []
    for size, channels_last, kind in params:
        mask = _mask(size, kind, g)
        layout.append((torch.Size(size), _strides(size, channels_last), mask))
        n = torch.Size(size).numel()
        memory = torch.ones(n, dtype=torch.bool) if mask is None else _memory_order(mask, channels_last)
        mask_support.append(memory)
        structured.append(torch.full((n,), kind != "unstructured"))
    mask_support, structured = torch.cat(mask_support), torch.cat(structured)
    numel = mask_support.numel()

    groups = GroupSupport(layout, numel)
    # the support, read back through a scatter of ones: structured masks exactly, unstructured ones covered
    support = groups.scatter(torch.ones(groups.kept), torch.full((numel,), 5.0)) == 1
    assert groups.kept == int(support.sum()) and groups.numel == numel
    assert torch.equal(support[structured], mask_support[structured])
    assert (support | ~mask_support).all()
    assert groups.segments == tuple(int(s.sum()) for s in support.split([s.numel() for s, _, _ in layout]))
    assert torch.equal(groups.digest, positions_digest(support.nonzero()))
    if bool(structured.all()):  # the digest pactrain's element support would give: the tracker's agreement
        assert torch.equal(groups.digest, positions_digest(bucket_support(layout, numel).nonzero()))

    grads = [torch.randn(numel, generator=g).to(dtype) for _ in range(world)]
    packed = []
    for grad in grads:
        original = grad.clone()
        out = torch.full((groups.kept + 3,), 7.0, dtype=dtype)
        assert groups.gather(grad, out) is out
        assert torch.equal(grad, original) and (out[groups.kept:] == 7).all()
        assert torch.equal(out[:groups.kept].sort().values, grad[support].sort().values)  # a permutation
        packed.append(out[:groups.kept])
        bucket = torch.full((numel,), float("nan"), dtype=dtype)
        assert groups.scatter(out, bucket) is bucket
        assert torch.equal(bucket, torch.where(support, grad, torch.zeros((), dtype=dtype)))

    total, dense = packed[0].clone(), grads[0].clone()
    for p, grad in zip(packed[1:], grads[1:]):
        total += p
        dense += grad
    bucket = torch.full((numel,), float("nan"), dtype=dtype)
    groups.scatter(total, bucket)
    assert torch.equal(bucket[support], dense[support])
    assert (bucket[~support] == 0).all()


def test_kept_filters_of_a_contiguous_weight_are_slices_of_the_bucket_in_order():
    """Filters 1 and 3 of a (4, 2, 3, 3) conv weight after a 5-entry bias: entries 5+18..5+36 and 5+54..5+72,
    packed as they lie, and indexed by 2 filters (16 bytes), not 36 entries (on the CPU path; the device path's
    index holds every kept position)."""
    mask = torch.zeros(4, 2, 3, 3)
    mask[[1, 3]] = 1
    size = mask.size()
    groups = GroupSupport([(torch.Size([5]), (1,), None), (size, _strides(size, False), mask)], 5 + 72)
    bucket = torch.arange(77.0)
    expected = torch.cat([torch.arange(5.0), torch.arange(23.0, 41.0), torch.arange(59.0, 77.0)])
    assert torch.equal(groups.gather(bucket, torch.empty(groups.kept)), expected)
    assert groups.index_bytes == 8 * 4 + device_index_bytes(groups.kept)  # 2 kept and 2 pruned filter indices


def test_group_dim_picks_the_dimension_that_sends_least():
    filters = torch.zeros(4, 6)
    filters[2] = 1
    assert group_dim(filters)[0] == 0
    channels = torch.zeros(4, 6)
    channels[:, 5] = 1
    assert group_dim(channels)[0] == 1
    assert group_dim(torch.ones(3, 3))[0] == 0  # a tie: filters
