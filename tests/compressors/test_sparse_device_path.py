"""The device path (``gcomp.kernels.forced``) of ``topk``, ``threshold`` and ``dgc`` keeps the CPU path's properties:
topk sends the k largest, NaN and infinities included; threshold sends the same entries in the same order, its count
read by the sized all-gather alone; error feedback conserves; no host synchronisation in the codec
(``gcomp.testing.ops.counting``); DGC's sample offset comes from its device stream, which the checkpoint resumes."""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gcomp
from gcomp import BucketInfo, kernels
from gcomp.collectives.allgather_sized import SizedPayload
from gcomp.compressors.sparse import magnitude_keys
from gcomp.compressors.threshold import ThresholdCompressor
from gcomp.compressors.topk import FULL, TopKCompressor
from gcomp.testing.ops import counting

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
needs_cpu_path = pytest.mark.skipif(bool(os.environ.get(kernels.ENV)),
                                    reason=f"compares with the CPU path, which {kernels.ENV} turns off")


def _bucket(n: int, dtype: torch.dtype, seed: int, specials: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-3, 3, (n,), generator=g)
    x = x.to(dtype)
    where = torch.randperm(n, generator=g)[:specials]
    x[where] = torch.tensor([float("nan"), float("inf"), float("-inf")], dtype=dtype)[
        torch.randint(0, 3, (where.numel(),), generator=g)]
    return x


def _conserves(name: str, dtype: torch.dtype, steps: int = 4, **params) -> None:
    """Error feedback on the device path: decoded payload + new residual == compensated bucket, bit for bit."""
    method = gcomp.create(name, **params)
    comp, memory = method.compressor, method.memory
    info = BucketInfo.from_layout(0, dtype, ["a", "b"], [3000, 77])
    for step in range(steps):
        with kernels.forced():
            v = memory.compensate(_bucket(info.numel, dtype, step), info)
            payload = comp.compress(v, info)
            memory.update(v, info, comp, payload)
            sent = comp.decompress(payload.tensors, payload.ctx)
            residual = memory.compensate(torch.zeros(info.numel, dtype=dtype), info)
        assert torch.equal(sent + residual, v), f"{name}, step {step}"
        assert residual.count_nonzero() > 0


# --- topk -------------------------------------------------------------------------------------------------------

@PROPERTY
@given(n=st.integers(1, 70_000), dtype=st.sampled_from(DTYPES), ratio=st.floats(1e-3, 1.0),
       seed=st.integers(0, 2**31 - 1), specials=st.integers(0, 40))
def test_topk_on_the_device_path_sends_the_k_largest_nonfinite_first(n, dtype, ratio, seed, specials):
    x = _bucket(n, dtype, seed, min(specials, n))
    k = max(1, int(n * ratio))
    comp = TopKCompressor(ratio)
    with kernels.forced():
        payload = comp.compress(x, BucketInfo.single(x))
    values, index = payload.tensors
    assert comp.paths[FULL] == 1 and index.shape == (k,) and index.unique().numel() == k
    keys = magnitude_keys(x)  # NaN above infinity above every finite magnitude
    assert torch.equal(keys[index.long()].sort().values, torch.topk(keys, k).values.sort().values)
    assert torch.equal(values.view(keys.dtype), x[index.long()].view(keys.dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_on_the_device_path_conserves(dtype):
    _conserves("topk", dtype, ratio=0.01)


def test_topk_on_the_device_path_never_waits_for_the_host():
    x = torch.randn(1 << 17)  # the CPU path samples a bound here and counts the candidates (a nonzero)
    with kernels.forced(), counting() as counter:
        TopKCompressor(0.01).compress(x, BucketInfo.single(x))
    assert counter.syncs == {} and counter.ops["topk"] == 1


# --- threshold --------------------------------------------------------------------------------------------------

@needs_cpu_path
@PROPERTY
@given(n=st.integers(1, 5000), dtype=st.sampled_from(DTYPES), threshold=st.floats(0, 3), world=st.integers(1, 4),
       seed=st.integers(0, 2**31 - 1), specials=st.integers(0, 5))
def test_threshold_on_the_device_path_sends_what_the_cpu_path_sends(n, dtype, threshold, world, seed, specials):
    x = _bucket(n, dtype, seed, min(specials, n))
    comp = ThresholdCompressor(threshold)
    comp.world_size = world
    info = BucketInfo.single(x)
    cpu = comp.compress(x, info)
    with kernels.forced():
        device = comp.compress(x, info)
    assert isinstance(device, SizedPayload) and not isinstance(cpu, SizedPayload)
    length = int(device.length)
    assert length == cpu.tensors[0].numel()
    for got, want in zip(device.tensors, cpu.tensors):  # the same entries, in the same order
        assert got.dtype == want.dtype and got.numel() == n
        assert torch.equal(got[:length].view(torch.uint8), want.view(torch.uint8))
    assert not device.tensors[0][length:].any()  # the padding adds nothing
    torch.testing.assert_close(comp.decompress(device.tensors, device.ctx), comp.decompress(cpu.tensors, cpu.ctx),
                               rtol=0, atol=0, equal_nan=True)
    for payload in (cpu, device):  # and leaves the same residual
        out = torch.empty_like(x)
        assert comp.residual_into(out, x, payload)
        if payload is cpu:
            expected = out
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_threshold_on_the_device_path_conserves(dtype):
    _conserves("threshold", dtype, threshold=1.0)


def test_threshold_on_the_device_path_leaves_the_count_on_the_device():
    """The codec never reads how many entries pass: the sized all-gather's read is the bucket's one sync."""
    x = torch.randn(1 << 17)
    comp = ThresholdCompressor(1.0)
    with kernels.forced():  # the threshold's key, made once
        comp.compress(torch.randn(8), BucketInfo.single(torch.randn(8)))
    with kernels.forced(), counting() as counter:
        payload = comp.compress(x, BucketInfo.single(x))
        comp.residual_into(torch.empty_like(x), x, payload)
        comp.decompress(payload.tensors, payload.ctx)
    assert counter.syncs == {}
    assert int(payload.length) == int((x.abs() > 1.0).sum())


# --- dgc --------------------------------------------------------------------------------------------------------

def _dgc(**params):
    return gcomp.create("dgc", ratio=0.001, momentum=0.0, **params).compressor


def test_dgc_draws_its_sample_offset_on_the_device_path_and_resumes_it():
    info = BucketInfo.single(torch.zeros(200_000))  # large enough to sample the threshold
    first, cpu_state = _dgc(), None
    with kernels.forced():
        cpu_state = first.generator.get_state()
        for step in range(2):
            first.compress(torch.randn(info.numel, generator=torch.Generator().manual_seed(step)), info)
    assert torch.equal(first.generator.get_state(), cpu_state)  # the host's generator drew nothing
    state = first.state_dict()
    assert state["device_stream"]["draws"] == 2
    resumed = _dgc(seed=7)
    resumed.load_state_dict(state)
    x = torch.randn(info.numel, generator=torch.Generator().manual_seed(9)) * 1e-3
    with kernels.forced(), counting() as counter:
        a = first.compress(x.clone(), info)
        b = resumed.compress(x.clone(), info)
    assert counter.syncs == {}
    assert all(torch.equal(s, t) for s, t in zip(a.tensors, b.tensors))
    assert "device_stream" not in _dgc().state_dict()  # the CPU path's checkpoint is as it was


@needs_cpu_path
@pytest.mark.parametrize("world", [1, 4])
def test_dgc_clipping_on_the_device_path_matches_the_cpu_path(world):
    info = BucketInfo.from_layout(0, torch.float64, ["big", "small", "empty", "last"], [10, 10, 0, 5])
    local = torch.cat([torch.full((10,), 10.0), torch.full((10,), 0.01), torch.full((5,), -3.0)]).double()
    sent = []
    for forced in (False, True):
        comp = _dgc(clip_norm=1.0)
        comp.world_size, comp.ratio = world, 1.0
        with kernels.forced() if forced else torch.no_grad():
            payload = comp.compress(local / world, info)
        sent.append(comp.decompress(payload.tensors, payload.ctx))
    torch.testing.assert_close(sent[1], sent[0], rtol=1e-12, atol=0)


# --- coded positions and narrow values ----------------------------------------------------------------------------

@pytest.mark.parametrize("name,params", [("topk", {"ratio": 0.05, "values": "bf16"}),
                                         ("topk", {"ratio": 0.4, "values": "fp8_e4m3"}),  # the bitmap form
                                         ("threshold", {"threshold": 1.0, "values": "fp16"}),
                                         ("threshold", {"threshold": 1.0, "values": "fp8_e4m3"})])
def test_narrow_values_on_the_device_path_conserve(name, params):
    _conserves(name, torch.float32, **params)


@pytest.mark.parametrize("values", ["fp32", "bf16", "fp8_e4m3"])
def test_coded_positions_take_no_host_synchronisation(values):
    """Encode, the residual, and the decode of every rank's code at once: no sync, on the device path."""
    x = torch.randn(50_000)
    comp, info = TopKCompressor(0.01, "coded", values), BucketInfo.single(x)
    with kernels.forced(), counting() as counter:
        payload = comp.compress(x, info)
        comp.residual_into(torch.empty_like(x), x, payload)
        out = comp.aggregate([torch.stack([t, t]) for t in payload.tensors], payload.ctx)
    assert counter.syncs == {}
    assert torch.equal(out, 2 * comp.decompress(payload.tensors, payload.ctx))
