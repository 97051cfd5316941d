"""The device path of ``signsgd``, ``signum``, ``efsignsgd`` and ``onebit`` (``gcomp.kernels.forced`` on CPU
tensors): bucket-wide (the same aten operations whatever the bucket's parameters and entries), no host
synchronisation, not even one inside an operation (``torch.profiler`` sees those), the CPU path's wire and, from
the same payloads, its decodes bit for bit; ranks summed in groups; the layout-free rows and segment sums without a host read.

The properties the two paths share (the scale, the vote, non-finite values, Signum's momentum, conservation,
layout independence) are the tests of test_sign.py and test_onebit.py, run on both paths."""
from __future__ import annotations

import collections
from contextlib import contextmanager

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.profiler import ProfilerActivity, profile

import gcomp
from gcomp import BucketInfo, kernels
from gcomp.compressors import sign_device
from gcomp.compressors.onebit import OneBitCompressor
from gcomp.compressors.sign import ROW, ScaledSignCompressor, pack_signs
from gcomp.compressors.sign_rows import AlignedRows
from gcomp.kernels import segments
from gcomp.testing.ops import SYNCING, counting

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
METHODS = [("signsgd", {}), ("signsgd", {"aggregate": "mean"}), ("signum", {}), ("efsignsgd", {}), ("onebit", {})]
# (parameters, entries): more parameters, then more entries than the CPU path's blocks (sign.BLOCK, and the
# 64 K bytes of bitpack.unpack_table) hold
SHAPES = [(4, 1 << 16), (64, 1 << 16), (4, 1 << 20)]


def _layout(numels, dtype=torch.float32) -> BucketInfo:
    return BucketInfo.from_layout(0, dtype, [f"p{i:03d}" for i in range(len(numels))], numels)


def _stack(payloads) -> list[torch.Tensor]:
    return [torch.stack([p.tensors[j] for p in payloads]) for j in range(len(payloads[0].tensors))]


@contextmanager
def _counted(counters: dict | None, part: str):
    """The block's operations as ``counters[part]`` (a later block of the same part replaces it)."""
    if counters is None:
        yield
        return
    with counting() as counter:
        yield
    counters[part] = counter


def _step(comp, xs, info, counters=None):
    """One bucket through the codec as the hook runs it: every rank's compress, the aggregate and one decode."""
    payloads = []
    for x in xs:
        with _counted(counters, "compress"):  # one rank's
            payloads.append(comp.compress(x, info))
    gathered = _stack(payloads)
    with _counted(counters, "aggregate"):
        comp.aggregate(gathered, payloads[0].ctx)
    with _counted(counters, "decompress"):
        comp.decompress(payloads[0].tensors, payloads[0].ctx)


def _codec_run(name, params, shape, world):
    params_count, numel = shape
    info = _layout([numel // params_count] * params_count)
    comp = gcomp.create(name, **params).compressor
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(numel, generator=g) for _ in range(world)]
    with kernels.forced("cuda"):
        _step(comp, xs, info)  # layouts and tables are made once, here
    return lambda counters=None: _step(comp, xs, info, counters)


# the most operations of each part (a regression guard: few, not only bounded)
MOST = {"compress": 32, "aggregate": 20, "decompress": 12}
MOST_ONEBIT = {"compress": 45, "aggregate": 25, "decompress": 18}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name, params", METHODS, ids=[f"{n}{p}" for n, p in METHODS])
def test_the_device_path_does_not_grow_with_parameters_or_entries(name, params, world):
    counts = {}
    for shape in SHAPES:
        run = _codec_run(name, params, shape, world)
        with kernels.forced("cuda"):
            run(counts.setdefault(shape, {}))
    for shape, parts in counts.items():
        for part, counter in parts.items():
            assert not counter.syncs, (shape, part, dict(counter.syncs))
            ops, first = sum(counter.ops.values()), sum(counts[SHAPES[0]][part].ops.values())
            assert ops == first, (shape, part, ops, first)
            most = (MOST_ONEBIT if name == "onebit" else MOST)[part]
            assert ops <= most, (part, ops, dict(counter.ops))


@pytest.mark.parametrize("name, params", METHODS, ids=[f"{n}{p}" for n, p in METHODS])
def test_no_host_synchronisation_hides_inside_an_operation(name, params):
    """``gcomp.testing.ops`` counts the operations it is handed; one that reads a number on the host inside itself
    (``segment_reduce`` checking its lengths) shows in the profiler's list of nested operations only."""
    run = _codec_run(name, params, (5, 5 * 3 * ROW + 35), 2)
    with kernels.forced("cuda"), profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    names = collections.Counter(e.name.removeprefix("aten::") for e in prof.events())
    assert not {k: v for k, v in names.items() if k in SYNCING or k == "item"}


def _values(n, dtype, seed, zeros=0.2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64) * 10 ** torch.empty(n, dtype=torch.float64).uniform_(
        -2, 2, generator=g)
    x[torch.rand(n, generator=g) < zeros] = 0.0
    return x.to(dtype)


@PROPERTY
@given(numels=st.lists(st.integers(0, 2 * ROW + 9), min_size=1, max_size=5).filter(lambda k: sum(k) > 0),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1), world=st.integers(1, 5),
       codec=st.sampled_from(["mean", "majority", "onebit"]))
def test_the_device_path_sends_the_cpu_wire_and_decodes_it_alike(numels, dtype, seed, world, codec):
    info = _layout(numels, dtype)
    comp = OneBitCompressor() if codec == "onebit" else ScaledSignCompressor(codec)
    xs = [_values(info.numel, dtype, seed + r) for r in range(world)]
    cpu = [comp.compress(x, info) for x in xs]
    with kernels.forced("cuda"):
        device = [comp.compress(x, info) for x in xs]
    for a, b in zip(cpu, device):
        assert torch.equal(a.tensors[0], b.tensors[0])  # the same bits
        torch.testing.assert_close(b.tensors[1], a.tensors[1], rtol=1e-6, atol=0)  # rows summed alike
    for payloads in (cpu, device):
        gathered, ctx = _stack(payloads), payloads[0].ctx
        on_cpu = comp.aggregate(gathered, ctx).clone(), comp.decompress(payloads[0].tensors, ctx).clone()
        with kernels.forced("cuda"):
            on_device = comp.aggregate(gathered, ctx), comp.decompress(payloads[0].tensors, ctx)
        for got, want in zip(on_device, on_cpu):
            assert got.dtype == dtype and got.shape == (info.numel,)
            assert torch.equal(got, want)  # ranks added in the same order, in fp32


@pytest.mark.parametrize("codec", ["mean", "majority", "onebit"])
def test_ranks_beyond_a_group_are_summed_group_by_group(codec, monkeypatch):
    info = _layout([300, 41, 7])
    comp = OneBitCompressor() if codec == "onebit" else ScaledSignCompressor(codec)
    payloads = [comp.compress(_values(info.numel, torch.float32, r), info) for r in range(7)]
    gathered, ctx = _stack(payloads), payloads[0].ctx
    want = comp.aggregate(gathered, ctx).clone()
    # (r0 + r1 + r2) + (r3 + r4 + r5) + r6 against r0 + ... + r6 in turn: fp32 sums of 7 terms apart
    bound = 8 * torch.finfo(torch.float32).eps * torch.stack(
        [comp.decompress(p.tensors, p.ctx).abs() for p in payloads]).sum(0)
    for setting, value in [("RANK_GROUP", 3), ("TABLE_BUDGET", 1)]:  # 3 ranks a turn; then 1
        monkeypatch.setattr(sign_device, setting, value)
        with kernels.forced("cuda"):
            got = comp.aggregate(gathered, ctx)
        if codec == "majority":  # whole vote counts: exact in any order
            assert torch.equal(got, want)
        else:
            assert ((got - want).abs() <= bound).all()
            assert not torch.equal(got, torch.zeros_like(got))


@pytest.mark.parametrize("n", [1, 7, 8, 63, 64, 65, 3 * ROW + 17])
def test_the_bits_are_packed_in_one_pass_as_on_the_cpu(n):
    x = _values(n, torch.float32, n, zeros=0.3)
    x[::5] = -0.0
    if n > 3:
        x[3] = float("nan")
    assert torch.equal(sign_device.pack_signs(x), pack_signs(x))


def test_aligned_rows_put_every_parameter_at_a_row_start_in_name_order():
    info = BucketInfo.from_layout(0, torch.float32, ["b", "c", "a", "e"], [5, 0, 3, 9])
    rows = AlignedRows(info, 17, 4)
    x = torch.arange(1.0, 18.0)
    got = rows.gather(x)
    assert got.shape == (1 + 3 + 2, 4) and rows.rows == (1, 2, 0, 3)  # a, b, c (empty), e
    assert got.tolist() == [[6, 7, 8, 0], [1, 2, 3, 4], [5, 0, 0, 0], [9, 10, 11, 12], [13, 14, 15, 16],
                            [17, 0, 0, 0]]
    assert rows.to_bucket(torch.tensor([10.0, 20.0, 30.0, 40.0])).tolist() == [20.0, 30.0, 10.0, 40.0]
    two = rows.gather(torch.stack([x, -x]))  # leading dimensions ride along
    assert torch.equal(two[0], got) and torch.equal(two[1], -got)
    assert rows.gather(torch.arange(1.0, 18.0)).data_ptr() != got.data_ptr()  # a copy, never a view of x


def test_segment_reduce_reads_no_length_on_the_host():
    values = torch.randn(2, 10, dtype=torch.float64)
    lengths = (3, 0, 7)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        got = segments.reduce(values, lengths, "sum", initial=0.0)
    torch.testing.assert_close(got, torch.stack([values[:, :3].sum(1), torch.zeros(2, dtype=torch.float64),
                                                 values[:, 3:].sum(1)], dim=1))
    assert not [e.name for e in prof.events() if e.name in ("aten::item", "aten::_local_scalar_dense")]
