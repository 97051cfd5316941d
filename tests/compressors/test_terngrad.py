"""``terngrad``: the 2-bit wire (hypothesis), unbiasedness (Monte Carlo), clipping, the shared-scale integer lanes
(simulated ranks and real gloo ranks, non-finite flag), each on the CPU and the device path, the draws of each
path, and a 4-rank convergence smoke test.

``converge_job`` / ``assert_converges`` are shared with the qsgd and natural tests.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import gcomp
from gcomp import BucketInfo
from gcomp.collectives import bitpack
from gcomp.compressors.quantise import wire_scale
from gcomp.compressors.terngrad import SharedScaleTernGradCompressor, TernGradCompressor
from tests.compressors.quant_paths import PATHS, cpu_draws, on_path
from tests.distributed import run_ranks
from tests.models import SEVERAL_BUCKETS_MB, batch, ddp, mlp, teacher_labels, train

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
PROPERTY = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def layout(sizes: list[int], dtype: torch.dtype) -> BucketInfo:
    return BucketInfo.from_layout(0, dtype, [f"p{i}" for i in range(len(sizes))], sizes)


def gradient(sizes: list[int], dtype: torch.dtype, seed: int, zeros: float = 0.0) -> torch.Tensor:
    """Segments with magnitudes from 1e-3 to 1e3 (fp16-safe), some entries zero."""
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(n, generator=g, dtype=torch.float64) * 10.0 ** (6 * torch.rand((), generator=g).item() - 3)
             for n in sizes]
    x = torch.cat(parts)
    x[torch.rand(x.numel(), generator=g) < zeros] = 0.0
    return x.to(dtype)


def segment_views(x: torch.Tensor, sizes: list[int]):
    return torch.split(x, sizes)


# --- the 2-bit wire -------------------------------------------------------------------------------------------


@PATHS
@PROPERTY
@given(sizes=st.lists(st.integers(0, 200), min_size=1, max_size=5).filter(lambda s: sum(s) > 0),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1), zeros=st.sampled_from([0.0, 0.3, 1.0]),
       world=st.integers(1, 5))
def test_codes_round_trip_and_aggregate_is_the_sum_of_decodes(path, sizes, dtype, seed, zeros, world):
    with on_path(path):
        _round_trip(sizes, dtype, seed, zeros, world)


def _round_trip(sizes, dtype, seed, zeros, world):
    info = layout(sizes, dtype)
    comps = [TernGradCompressor(clip=0.0, seed=r) for r in range(world)]
    xs = [gradient(sizes, dtype, seed + r, zeros) for r in range(world)]
    payloads = [c.compress(x, info) for c, x in zip(comps, xs)]
    n, segments = sum(sizes), len(sizes)
    for x, p in zip(xs, payloads):
        scales, words = p.tensors
        assert scales.dtype == torch.float32 and scales.shape == (segments,)
        assert words.dtype == torch.int64 and words.numel() == -(-n // 32)
        assert p.nbytes == 4 * segments + 8 * -(-n // 32)  # 2 bits per entry, 32 per parameter
        decoded = comps[0].decompress(p.tensors, p.ctx)
        assert decoded.shape == x.shape and decoded.dtype == dtype
        codes = bitpack.unpack(words, n, 2)
        assert int(codes.max()) <= 2  # t + 1 in {0, 1, 2}
        for j, (xs_j, ds_j, cs_j) in enumerate(zip(segment_views(x, sizes), segment_views(decoded, sizes),
                                                   segment_views(codes, sizes))):
            if not xs_j.numel():
                continue
            s = scales[j].double()
            assert s >= xs_j.double().abs().max()  # max |g| (rounded up to fp32 for fp64 buckets)
            t = cs_j - 1
            assert torch.equal(ds_j, (t.double() * s).to(dtype))
            assert ((t == 0) | (t == xs_j.double().sign().long())).all()  # a sent entry keeps its sign
            assert (t[xs_j == 0] == 0).all()
    stacked = [torch.stack([p.tensors[j] for p in payloads]) for j in range(2)]
    total = comps[0].aggregate(stacked, payloads[0].ctx)
    parts = torch.stack([comps[0].decompress(p.tensors, p.ctx).double() for p in payloads])
    eps = torch.finfo(dtype).eps
    assert total.dtype == dtype
    assert ((total.double() - parts.sum(0)).abs() <= (world + 1) * eps * parts.abs().sum(0)).all()


@PATHS
def test_fp64_scale_is_rounded_up_to_fp32(path):
    x = torch.tensor([1.0 + 2.0**-40, -0.5], dtype=torch.float64)
    assert wire_scale(x.abs().max()).double() > x.abs().max()
    with on_path(path):
        payload = TernGradCompressor(clip=0.0).compress(x, BucketInfo.single(x))
    assert payload.tensors[0].double() >= 1.0 + 2.0**-40


# --- statistics ------------------------------------------------------------------------------------------------


@PATHS
def test_unbiased_without_clipping(path):
    """Mean of 4000 draws within 6 standard errors of g, entry by entry; Var(s t) = s |g| - g^2."""
    sizes = [40, 9, 1]
    info = layout(sizes, torch.float32)
    x = gradient(sizes, torch.float32, seed=3)
    comp = TernGradCompressor(clip=0.0, seed=1)
    trials = 4000
    total = torch.zeros(x.numel(), dtype=torch.float64)
    with on_path(path):
        for _ in range(trials):
            p = comp.compress(x, info)
            total += comp.decompress(p.tensors, p.ctx).double()
    scale = torch.cat([torch.full((n,), float(v.abs().max())) for n, v in zip(sizes, segment_views(x, sizes))])
    g = x.double()
    var = (scale.double() * g.abs() - g * g).clamp(min=0)
    bound = 6 * (var / trials).sqrt() + 1e-6 * scale.double()
    assert ((total / trials - g).abs() <= bound).all()


@PATHS
def test_clipping_caps_the_scale_and_sends_outliers_as_the_scale(path):
    x = torch.zeros(1000)
    x[:999] = torch.randn(999, generator=torch.Generator().manual_seed(0))
    x[999] = 100.0  # an outlier far past 2.5 sigma
    comp = TernGradCompressor(clip=2.5)
    with on_path(path):
        p = comp.compress(x, BucketInfo.single(x))
        s = p.tensors[0][0]
        torch.testing.assert_close(s, 2.5 * torch.std(x, correction=0))
        assert comp.decompress(p.tensors, p.ctx)[999] == s  # |g| > s: always +s
        # a one-entry parameter has std 0: it is not clipped to zero
        one = torch.tensor([3.0])
        p = comp.compress(one, BucketInfo.single(one))
        assert p.tensors[0][0] == 3.0 and comp.decompress(p.tensors, p.ctx)[0] == 3.0


@PATHS
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_entry_makes_its_parameter_nonfinite(path, bad):
    sizes = [10, 6]
    x = gradient(sizes, torch.float32, seed=0)
    x[2] = bad
    comp = TernGradCompressor(clip=2.5)
    with on_path(path):
        p = comp.compress(x, layout(sizes, torch.float32))
        other = comp.compress(torch.ones(16), layout(sizes, torch.float32))
        out = comp.aggregate([torch.stack([a, b]) for a, b in zip(p.tensors, other.tensors)], p.ctx)
    assert not out[:10].isfinite().any()
    assert out[10:].isfinite().all()


# --- shared scale: integer lanes ---------------------------------------------------------------------------------
# Ranks simulated in one process: one compressor per rank told the world size, MAX as fmax (it drops a NaN, as a
# real MAX all-reduce may), SUM as a sum of the int64 words.


def _simulate(xs: list[torch.Tensor], info: BucketInfo, clip: float = 0.0):
    world = len(xs)
    comps = [SharedScaleTernGradCompressor(clip=clip, seed=r) for r in range(world)]
    for c in comps:
        c.world_size = world
    payloads = [c.compress(x, info) for c, x in zip(comps, xs)]
    shared = payloads[0].tensors[0].clone()
    for p in payloads[1:]:
        shared = torch.fmax(shared, p.tensors[0])
    for c, p in zip(comps, payloads):
        p.tensors[0].copy_(shared)
        c.second_round(p)
    lanes = sum(p.tensors[1] for p in payloads)
    return comps, payloads, shared, lanes


@PATHS
@PROPERTY
@given(sizes=st.lists(st.integers(1, 150), min_size=1, max_size=4), world=st.integers(1, 9),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1), clip=st.sampled_from([0.0, 2.5]))
def test_integer_sum_decode_equals_the_sum_of_decoded_codes(path, sizes, world, dtype, seed, clip):
    with on_path(path):
        _integer_sum(sizes, world, dtype, seed, clip)


def _integer_sum(sizes, world, dtype, seed, clip):
    info = layout(sizes, dtype)
    xs = [gradient(sizes, dtype, seed + r, zeros=0.2) for r in range(world)]
    comps, payloads, shared, lanes = _simulate(xs, info, clip)
    n, bits = sum(sizes), bitpack.lane_bits(world)
    assert payloads[0].nbytes == 4 * (len(sizes) + 1) + 8 * bitpack.packed_words(n, bits)
    scale = torch.cat([torch.full((k,), float(s)) for k, s in zip(sizes, shared[:-1])]).double()
    codes = torch.stack([bitpack.unpack(p.tensors[1], n, bits) - 1 for p in payloads])  # each rank's own t
    assert int(codes.abs().max()) <= 1
    for r, x in enumerate(xs):
        assert ((codes[r] == 0) | (codes[r] == x.double().sign().long())).all()
    for c, p in zip(comps, payloads):  # every rank decodes the sum with its own context
        out = c.decompress([shared, lanes.clone()], p.ctx)
        assert out.dtype == dtype
        expected = (codes.sum(0).double() * scale).to(dtype)
        assert torch.equal(out, expected)


@PATHS
def test_shared_scale_unbiased_on_three_ranks(path):
    sizes = [30, 5]
    info = layout(sizes, torch.float32)
    xs = [gradient(sizes, torch.float32, seed=r) for r in range(3)]
    world, trials = 3, 1000
    comps = [SharedScaleTernGradCompressor(clip=0.0, seed=r) for r in range(world)]
    for c in comps:
        c.world_size = world
    total = torch.zeros(35, dtype=torch.float64)
    with on_path(path):
        for _ in range(trials):  # copies: the decode writes into the compressed tensor, as into the hook's bucket
            payloads = [c.compress(x.clone(), info) for c, x in zip(comps, xs)]
            shared = torch.stack([p.tensors[0] for p in payloads]).amax(0)
            for c, p in zip(comps, payloads):
                p.tensors[0].copy_(shared)
                c.second_round(p)
            total += comps[0].decompress([shared, sum(p.tensors[1] for p in payloads)], payloads[0].ctx).double()
    scale = torch.cat([torch.full((k,), float(s)) for k, s in zip(sizes, shared[:-1])]).double()
    g = torch.stack([x.double() for x in xs])
    var = (scale * g.abs() - g * g).clamp(min=0).sum(0)
    bound = 6 * (var / trials).sqrt() + 1e-6 * scale
    assert ((total / trials - g.sum(0)).abs() <= bound).all()


@PATHS
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_shared_scale_flag_surfaces_a_nan_the_max_dropped(path, bad):
    sizes = [8, 8]
    info = layout(sizes, torch.float32)
    xs = [gradient(sizes, torch.float32, seed=r) for r in range(3)]
    xs[2][12] = bad  # in the second parameter of the last rank
    with on_path(path):
        comps, payloads, shared, lanes = _simulate(xs, info)
        if bad != bad:
            assert shared[1].isfinite()  # fmax dropped the NaN scale: only the flag carries it
        assert shared[-1] == 1
        for c, p in zip(comps, payloads):
            assert c.decompress([shared, lanes.clone()], p.ctx).isnan().all()


# --- real ranks ------------------------------------------------------------------------------------------------


def shared_scale_job(bad_rank: int) -> list[torch.Tensor]:
    """Through ChainedAllreduceCommunicator on gloo: a clean bucket, then one with a NaN on ``bad_rank``."""
    rank = dist.get_rank()
    method = gcomp.create("terngrad", collective="allreduce", clip=0.0)
    method.compressor.bind(None, None, {})
    sizes = [50, 7]
    info = layout(sizes, torch.float32)
    out = []
    for step in range(2):
        x = gradient(sizes, torch.float32, seed=10 * step + rank)
        if step == 1 and rank == bad_rank:
            x[3] = float("nan")
        payload = method.compressor.compress(x, info)
        future = method.communicator.exchange(payload, method.compressor, None)
        out.append(method.communicator.decode(future.wait(), method.compressor, payload.ctx))
    return out


def test_shared_scale_on_gloo_ranks_agree_and_surface_nan():
    results = run_ranks(4, shared_scale_job, 3)
    for clean, poisoned in results:
        assert torch.equal(clean, results[0][0])
        assert clean.isfinite().all() and clean.abs().sum() > 0
        assert poisoned.isnan().all()


# --- convergence smoke test (shared with test_qsgd, test_natural) -------------------------------------------------

SMOKE_STEPS = 40
LR = 0.5


def teacher_batch(rank: int, size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's fixed batch, labelled by a fixed random linear teacher (learnable, unlike random labels)."""
    x, _ = batch(0, rank, size)
    return x, teacher_labels(x, seed=99)


def converge_job(runs: list[tuple[str | None, dict]], steps: int = SMOKE_STEPS, lr: float = LR,
                 seed: int = 0) -> list[dict]:
    """Per run (None: plain DDP), full-batch SGD on each rank's own fixed teacher-labelled batch of 64: the mean
    over ranks of the loss before and after ``steps`` steps, and this rank's final parameters."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = teacher_batch(rank)
    out = []
    for name, params in runs:
        model = mlp(seed)
        net = ddp(model)
        if name is not None:
            gcomp.install(net, name, **params)
        opt = torch.optim.SGD(net.parameters(), lr=lr)
        first = None
        for _ in range(steps):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            first = loss.detach() if first is None else first
        with torch.no_grad():
            last = nn.functional.cross_entropy(model(x), y)
        losses = torch.stack([first, last])
        dist.all_reduce(losses)
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        out.append({"losses": losses / world, "params": params})
    return out


def assert_converges(runs: list[tuple[str | None, dict]], bounds: list[float]) -> None:
    """Each run's final loss is at most ``bound`` times the initial one; the first run is plain DDP (its ratio
    is reported in the message); replicas end identical."""
    results = run_ranks(4, converge_job, runs)
    dense = results[0][0]["losses"]
    for i, ((name, params), bound) in enumerate(zip(runs, bounds)):
        first, last = results[0][i]["losses"].tolist()
        assert math.isfinite(last) and last <= bound * first, (
            f"{name}{params}: loss {first:.4f} -> {last:.4f} (ratio {last / first:.3f}, bound {bound}); "
            f"dense DDP: {dense[0]:.4f} -> {dense[1]:.4f}")
        for r in results[1:]:
            assert torch.equal(r[i]["params"], results[0][i]["params"]), f"{name}: replicas differ"


def test_terngrad_lowers_the_loss_on_four_ranks():
    # Dense DDP ends at about 0.36 of its initial loss (bound 0.45). TernGrad measured 0.41 (clip 2.5, either
    # collective) and 0.37 (no clipping): clipping biases the outliers and the ternary variance (s |g| per entry)
    # slows it, hence 0.5.
    assert_converges([(None, {}), ("terngrad", {}), ("terngrad", {"collective": "allreduce"}),
                      ("terngrad", {"clip": 0.0})],
                     [0.45, 0.5, 0.5, 0.5])


def several_buckets_job(static: bool) -> dict:
    """terngrad over the shared-scale all-reduce on DDP with several buckets (the MAX round is waited for in the
    hook of each bucket while earlier buckets' SUMs are in flight)."""
    model = mlp(0)
    net = ddp(model, bucket_cap_mb=SEVERAL_BUCKETS_MB, static_graph=static)
    state = gcomp.install(net, "terngrad", collective="allreduce")
    train(net, 4)
    return {"params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]), "stats": dict(state.stats)}


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_shared_scale_in_ddp_with_several_buckets(static):
    results = run_ranks(4, several_buckets_job, static)
    numel = results[0]["params"].numel()
    for r in results:
        assert torch.equal(r["params"], results[0]["params"]) and r["params"].isfinite().all()
        assert r["stats"]["buckets"] > r["stats"]["steps"]  # several buckets per step
        # 4-bit lanes (4 ranks: a field sums to at most 8) plus the scales: an eighth of fp32's bytes and a little
        assert r["stats"]["bytes_dense"] == 16 * numel
        assert r["stats"]["bytes_sent"] < r["stats"]["bytes_dense"] / 4 + 400


@PATHS
def test_work_buffers_are_kept_per_layout_and_the_hook_decode_writes_into_the_bucket(path):
    """The draws and codes buffers of a layout are allocated once and reused at every later step; ``aggregate``
    returns the compressed tensor itself (no result of the bucket's size per step), ``decompress`` a new one."""
    with on_path(path):
        _work_buffers()


def _work_buffers():
    comp = TernGradCompressor(clip=0.0)
    x = gradient([300, 20], torch.float32, seed=1)
    info = layout([300, 20], torch.float32)
    first = comp.compress(x.clone(), info)
    kept = {name: b.data_ptr() for name, b in comp.scratch._buffers.items()}
    assert {name for _, name in kept} == {"draws", "codes", "hit", "uniform"}
    held = {name: b.data_ptr() for name, b in comp._bernoulli[info.key].items()}  # draw_hits' bytes and ties
    bucket = x.clone()
    second = comp.compress(bucket, info)
    assert {name: b.data_ptr() for name, b in comp.scratch._buffers.items()} == kept
    assert {name: b.data_ptr() for name, b in comp._bernoulli[info.key].items()} == held
    alone = comp.decompress(second.tensors, second.ctx)
    assert alone.data_ptr() != bucket.data_ptr() and not torch.equal(first.tensors[1], second.tensors[1])
    total = comp.aggregate([t.unsqueeze(0) for t in second.tensors], second.ctx)
    assert total.data_ptr() == bucket.data_ptr() and torch.equal(total, alone)


@PROPERTY
@given(words=st.integers(1, 40), seed=st.integers(0, 2**31 - 1))
def test_pack_codes_and_the_table_decode_match_bitpack(words, seed):
    from gcomp.compressors.terngrad import code_table, pack_codes_, unpack_codes
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 4, (words * 32,), generator=g, dtype=torch.uint8)
    expected = bitpack.pack(codes, 2)
    assert torch.equal(pack_codes_(codes.clone()), expected)
    n = words * 32 - int(torch.randint(0, 32, (1,), generator=g))
    decoded = unpack_codes(expected, n, code_table("cpu"), torch.empty(words * 32))
    assert torch.equal(decoded, bitpack.unpack(expected, n, 2, dtype=torch.float32) - 1)


@cpu_draws
def test_codes_are_bernoulli_hits_drawn_a_byte_per_entry_from_the_own_stream():
    """The codes equal ``bernoulli.draw_hits`` against ``256 |g| / scale`` on a copy of the compressor's stream
    (one random byte per entry), signed by g; the stream is left where that draw leaves it."""
    from gcomp.compressors import bernoulli
    sizes = [3000, 17, 1]
    info, x = layout(sizes, torch.float32), gradient(sizes, torch.float32, seed=6)
    comp = TernGradCompressor(clip=2.5, seed=2)
    reference = torch.Generator().set_state(comp.random("cpu").get_state())
    p = comp.compress(x, info)
    scales = p.tensors[0]
    prob = torch.cat([v.abs() / s * 256 for v, s in zip(segment_views(x, sizes), scales)])
    hit = torch.empty(x.numel(), dtype=torch.bool)
    bernoulli.draw_hits(hit, prob, reference, {})
    expected = torch.where(hit, torch.where(x > 0, 2, 0), 1)
    assert torch.equal(bitpack.unpack(p.tensors[1], x.numel(), 2), expected)
    assert torch.equal(comp.random("cpu").get_state(), reference.get_state())


@pytest.mark.parametrize("collective", ["allgather", "allreduce"])
def test_the_device_path_draws_one_uniform_per_entry_from_the_own_stream(collective):
    """On the device path the codes equal ``bernoulli.draw_hits_device`` (one uniform on [0, 256) per entry) against
    ``256 |g| / scale`` on a copy of the compressor's stream, signed by g, in either form; the stream is left where
    that draw leaves it."""
    from gcomp.compressors import bernoulli
    sizes = [3000, 17, 0, 1]
    info, x = layout(sizes, torch.float32), gradient(sizes, torch.float32, seed=6, zeros=0.1)
    comp = (TernGradCompressor if collective == "allgather" else SharedScaleTernGradCompressor)(clip=2.5, seed=2)
    reference = torch.Generator().set_state(comp.random("cpu").get_state())
    with on_path("device"):
        p = comp.compress(x, info)
        if collective == "allreduce":
            comp.second_round(p)
    scales = p.tensors[0][:len(sizes)]
    prob = torch.cat([v.abs() / s * 256 for v, s in zip(segment_views(x, sizes), scales)])
    hit = torch.empty(x.numel(), dtype=torch.bool)
    bernoulli.draw_hits_device(hit, prob, reference, {})
    expected = torch.where(hit, torch.where(x > 0, 2, 0), 1)
    bits = 2 if collective == "allgather" else bitpack.lane_bits(1)
    assert torch.equal(bitpack.unpack(p.tensors[1], x.numel(), bits), expected)
    assert torch.equal(comp.random("cpu").get_state(), reference.get_state())
