"""``topk``: the codec's properties (hypothesis), error-feedback conservation, ratio=1 equals the dense mean on
several ranks, non-finite values always sent, no host synchronisation. Its residuals across bucket layouts:
tests/test_memory.py."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import gcomp
from gcomp import BucketInfo, ResidualMemory
from gcomp.compressors.sparse.topk import TopKCompressor, magnitude_keys
from gcomp.testing.ops import counting
from tests.distributed import run_ranks
from tests.models import SEVERAL_BUCKETS_MB, batch, ddp, mlp

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
KINDS = ["normal", "ties", "wide"]

PROPERTY = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])

ratios = st.one_of(st.floats(min_value=0.0, max_value=1.0, exclude_min=True, allow_nan=False, allow_subnormal=False),
                   st.sampled_from([1.0, 0.5, 1e-9, 0.999]))


def _k(n: int, ratio: float) -> int:
    return max(1, int(ratio * n))


def _values(n: int, dtype: torch.dtype, seed: int, kind: str) -> torch.Tensor:
    """``normal``: Gaussian; ``ties``: small integers (many equal magnitudes, exact sums); ``wide``: magnitudes
    spread over eight decades, small enough that a sum over 8 ranks stays within float16's range."""
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        x = torch.randn(n, generator=g, dtype=torch.float64)
    elif kind == "ties":
        x = torch.randint(-3, 4, (n,), generator=g).to(torch.float64)
    else:
        x = torch.randn(n, generator=g, dtype=torch.float64) * 10 ** torch.empty(n, dtype=torch.float64).uniform_(
            -4, 4, generator=g)
        x = x.clamp(-6000, 6000)
    return x.to(dtype)


# --- the codec ----------------------------------------------------------------------------------------------


def encode(comp, x, info=None):
    return comp.encode(x, {}, info or BucketInfo.single(x))[0]


def decode_alone(comp, payload):
    """One rank's payload decoded alone: a one-rank stack, as the all-gather delivers it."""
    return comp.decode([t[None] for t in payload.tensors], payload.ctx)


@PROPERTY
@given(n=st.integers(1, 2000), dtype=st.sampled_from(DTYPES), ratio=ratios, seed=st.integers(0, 2**31 - 1),
       kind=st.sampled_from(KINDS))
def test_encode_sends_the_k_largest_and_decode_places_them(n, dtype, ratio, seed, kind):
    x = _values(n, dtype, seed, kind)
    comp = TopKCompressor(ratio)
    payload = encode(comp, x)
    k = _k(n, ratio)

    values, index = payload.tensors
    assert values.dtype == dtype and values.shape == (k,)
    assert index.dtype == torch.int32 and index.shape == (k,)
    assert payload.nbytes == k * (x.element_size() + 4)
    index64 = index.long()
    assert int(index64.min()) >= 0 and int(index64.max()) < n
    assert index64.unique().numel() == k
    assert torch.equal(values, x[index64])

    out = decode_alone(comp, payload)
    assert out.shape == x.shape and out.dtype == dtype
    kept = torch.zeros(n, dtype=torch.bool)
    kept[index64] = True
    assert torch.equal(out[index64], values)
    assert torch.equal(out[~kept], torch.zeros(n - k, dtype=dtype))
    assert torch.equal(payload.residual, x.masked_fill(kept, 0))  # what error feedback keeps: no decode needed

    magnitude = x.double().abs()
    if k < n:
        assert magnitude[kept].min() >= magnitude[~kept].max()  # the k-th largest magnitude is the threshold
    threshold = magnitude.sort(descending=True).values[k - 1]
    assert (magnitude > threshold).logical_and(~kept).sum() == 0
    assert (magnitude[kept] >= threshold).all()


@PROPERTY
@given(n=st.integers(1, 2000), dtype=st.sampled_from(DTYPES), ratio=ratios, seed=st.integers(0, 2**31 - 1),
       kind=st.sampled_from(KINDS), world=st.integers(1, 8))
def test_decode_of_a_stack_is_the_sum_of_decodes(n, dtype, ratio, seed, kind, world):
    comp = TopKCompressor(ratio)
    base = _values(n, torch.float64, seed, kind)
    payloads = []
    for r in range(world):  # a shared base with a little per-rank noise: the ranks pick overlapping entries
        noise = _values(n, torch.float64, seed + 1 + r, "ties" if kind == "ties" else "normal")
        x = (base + (noise.sign() if kind == "ties" else 0.1 * noise)).to(dtype)
        payloads.append(encode(comp, x))
    ctx = payloads[0].ctx
    gathered = [torch.stack([p.tensors[j] for p in payloads]) for j in range(2)]
    assert gathered[0].shape == (world, _k(n, ratio))

    out = comp.decode(gathered, ctx)
    assert out.shape == (n,) and out.dtype == dtype
    decoded = torch.stack([decode_alone(comp, p).double() for p in payloads])
    expected = decoded.sum(0)
    if kind == "ties":  # small integers: every partial sum is exact in every dtype
        assert torch.equal(out.double(), expected)
    else:
        info = torch.finfo(dtype)
        bound = world * info.eps * decoded.abs().sum(0) + world * info.tiny
        assert ((out.double() - expected).abs() <= bound).all()
    # the entries no rank selected stay exactly zero
    selected = torch.zeros(n, dtype=torch.bool)
    selected[gathered[1].reshape(-1).long()] = True
    assert torch.equal(out[~selected], torch.zeros(int((~selected).sum()), dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_entries_chosen_by_several_ranks_are_summed(dtype):
    comp = TopKCompressor(0.5)
    xs = [torch.tensor([5.0, 0.0, 1.0, -7.0]), torch.tensor([3.0, 2.0, 0.0, -4.0]), torch.tensor([0.0, 0.5, 6.0, 1.0])]
    payloads = [encode(comp, x.to(dtype)) for x in xs]
    gathered = [torch.stack([p.tensors[j] for p in payloads]) for j in range(2)]
    out = comp.decode(gathered, payloads[0].ctx)
    # rank 0 sends {0: 5, 3: -7}, rank 1 {0: 3, 3: -4}, rank 2 {2: 6, 3: 1}
    assert torch.equal(out, torch.tensor([8.0, 0.0, 6.0, -10.0], dtype=dtype))


# --- non-finite values --------------------------------------------------------------------------------------


@PROPERTY
@given(n=st.integers(2, 600), dtype=st.sampled_from(DTYPES), ratio=ratios, seed=st.integers(0, 2**31 - 1),
       data=st.data())
def test_nan_and_inf_are_always_selected(n, dtype, ratio, seed, data):
    k = _k(n, ratio)
    count = data.draw(st.integers(1, min(n, 2 * k)), label="non-finite entries")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    x[torch.randperm(n, generator=g)[: n // 4]] = torch.finfo(dtype).max / 2  # huge finite rivals
    where = torch.randperm(n, generator=g)[:count]
    specials = torch.tensor([float("nan"), float("inf"), float("-inf")], dtype=dtype)
    x[where] = specials[torch.randint(0, 3, (count,), generator=g)]

    comp = TopKCompressor(ratio)
    payload = encode(comp, x)
    values, index = payload.tensors
    sent = set(index.long().tolist())
    nonfinite = set(where.tolist())
    if count <= k:
        assert nonfinite <= sent
    else:
        assert sent <= nonfinite
    out = decode_alone(comp, payload)
    chosen = torch.tensor(sorted(nonfinite & sent))
    assert torch.equal(out[chosen].isnan(), x[chosen].isnan())
    assert torch.equal(out[chosen].isposinf(), x[chosen].isposinf())
    assert torch.equal(out[chosen].isneginf(), x[chosen].isneginf())

    # stacked with a finite rank, the non-finite entries still come out non-finite
    other = encode(comp, torch.ones(n, dtype=dtype))
    gathered = [torch.stack([payload.tensors[j], other.tensors[j]]) for j in range(2)]
    assert not comp.decode(gathered, payload.ctx)[chosen].isfinite().any()


@PROPERTY
@given(n=st.integers(1, 70_000), dtype=st.sampled_from(DTYPES), ratio=st.floats(1e-3, 1.0),
       seed=st.integers(0, 2**31 - 1), specials=st.integers(0, 40))
def test_the_k_largest_magnitude_keys_nonfinite_first_on_large_buckets(n, dtype, ratio, seed, specials):
    """torch.topk's set of magnitude keys (NaN above infinity above every finite magnitude), up to ties."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-3, 3, (n,), generator=g)).to(dtype)
    where = torch.randperm(n, generator=g)[:min(specials, n)]
    x[where] = torch.tensor([float("nan"), float("inf"), float("-inf")], dtype=dtype)[
        torch.randint(0, 3, (where.numel(),), generator=g)]
    k = _k(n, ratio)
    values, index = encode(TopKCompressor(ratio), x).tensors
    assert index.shape == (k,) and index.unique().numel() == k
    keys = magnitude_keys(x)
    assert torch.equal(keys[index.long()].sort().values, torch.topk(keys, k).values.sort().values)
    assert torch.equal(values.view(keys.dtype), x[index.long()].view(keys.dtype))


# --- error feedback -----------------------------------------------------------------------------------------


def ef_step(method, grad, info):
    """One bucket through the method's compensate, encode and residual: (compensated, payload)."""
    v = method.memory.compensate(grad, info)
    payload, _ = method.compressor.encode(v, {}, info)
    method.memory.update(v, info, payload.residual)
    return v, payload


@pytest.mark.parametrize("ratio", [0.03, 0.5, 1.0])
@pytest.mark.parametrize("dtype", DTYPES)
def test_error_feedback_conservation_is_exact(dtype, ratio):
    method = gcomp.create("topk", ratio=ratio)
    comp, memory = method.compressor, method.memory
    assert isinstance(memory, ResidualMemory)
    info = BucketInfo.from_layout(0, dtype, ["a", "b"], [200, 57])
    g = torch.Generator().manual_seed(7)

    def residual() -> torch.Tensor:
        stored = memory.state_dict()["residuals"]
        if not stored:
            return torch.zeros(info.numel, dtype=dtype)
        return torch.cat([stored[name].reshape(-1) for name in info.names])

    for step in range(6):
        grad = (torch.randn(info.numel, generator=g, dtype=torch.float64) * (step + 1)).to(dtype)
        old = residual()
        v, payload = ef_step(method, grad, info)
        assert torch.equal(v, grad + old)
        new = residual()
        assert torch.equal(decode_alone(comp, payload) + new, grad + old)
        if ratio < 1.0:
            assert new.count_nonzero() > 0  # something was held back, so the check above meant something
        else:
            assert new.count_nonzero() == 0


@pytest.mark.parametrize("values", ["fp32", "bf16", "fp8_e4m3"])
def test_error_feedback_conservation_on_a_large_bucket_with_nonfinite_steps(values):
    method = gcomp.create("topk", ratio=0.01, values=values)
    comp, memory = method.compressor, method.memory
    info = BucketInfo.from_layout(0, torch.float32, ["a", "b"], [1 << 16, 1000])
    g = torch.Generator().manual_seed(8)
    for step in range(4):
        grad = torch.randn(info.numel, generator=g)
        if step == 2:
            grad[[5, 77]] = torch.tensor([float("nan"), float("inf")])
        old = memory.compensate(torch.zeros(info.numel), info).clone()
        v, payload = ef_step(method, grad, info)
        new = memory.compensate(torch.zeros(info.numel), info)
        sent = decode_alone(comp, payload)
        expected = torch.nan_to_num(v - sent, nan=0.0, posinf=0.0, neginf=0.0)  # what the memory keeps
        assert torch.equal(new, expected) and new.isfinite().all()
        if step != 2:
            assert torch.equal(sent + new, grad + old)


# --- ratio 1 through DDP: the dense mean --------------------------------------------------------------------


def _loss(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    x, y = batch(step, rank)
    return nn.functional.cross_entropy(model(x), y)


def _topk_ratio_one_job(bucket_cap_mb: float | None, steps: int):
    """DDP with topk(ratio=1) next to a hand-made mean: each local gradient scaled by 1/world, SUM all-reduced."""
    torch.manual_seed(0)
    world, rank = dist.get_world_size(), dist.get_rank()
    model, reference = mlp(seed=0), mlp(seed=0)
    kwargs = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    net = ddp(model, **kwargs)
    state = gcomp.install(net, "topk", ratio=1.0)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    compared = []
    for step in range(state.warmup + steps):
        reference.load_state_dict(model.state_dict())
        reference.zero_grad()
        _loss(reference, step, rank).backward()
        manual = [p.grad * (1.0 / world) for p in reference.parameters()]
        for grad in manual:
            dist.all_reduce(grad)
        opt.zero_grad()
        _loss(net, step, rank).backward()
        if step >= state.warmup:
            compared.append(([p.grad.clone() for p in model.parameters()], manual))
        opt.step()
    return compared, dict(state.stats), state.warmup


@pytest.mark.parametrize("bucket_cap_mb", [None, SEVERAL_BUCKETS_MB], ids=["one-bucket", "several-buckets"])
@pytest.mark.parametrize("world", [2, 3])
def test_topk_ratio_one_equals_the_dense_mean(world, bucket_cap_mb):
    steps = 3
    results = run_ranks(world, _topk_ratio_one_job, bucket_cap_mb, steps)
    for compared, stats, warmup in results:
        assert warmup >= 1 and stats["warmup_steps"] == warmup
        assert stats["buckets"] - stats["dense_buckets"] >= steps  # the topk path really ran
        assert len(compared) == steps
        for got, manual in compared:
            for g, m in zip(got, manual):
                if world == 2:  # a sum of two terms does not depend on the order: bit for bit
                    assert torch.equal(g, m)
                else:
                    torch.testing.assert_close(g, m, rtol=1e-6, atol=1e-8)
    first = results[0][0]
    for compared, _, _ in results[1:]:  # every rank ends with the same gradients
        for (got, _), (got0, _) in zip(compared, first):
            assert all(torch.equal(a, b) for a, b in zip(got, got0))


# --- bucket-wide, pure -------------------------------------------------------------------------------------


@pytest.mark.parametrize("values", ["fp32", "bf16", "fp8_e4m3"])
def test_coded_positions_take_no_host_synchronisation(values):
    """Encode and the decode of every rank's code at once: one torch.topk, no sync."""
    x = torch.randn(50_000)
    comp = TopKCompressor(0.01, "coded", values)
    with counting() as counter:
        payload = encode(comp, x)
        out = comp.decode([torch.stack([t, t]) for t in payload.tensors], payload.ctx)
    assert counter.syncs == {} and counter.ops["topk"] == 1
    assert torch.equal(out, 2 * decode_alone(comp, payload))


def test_a_codec_is_a_pure_pair():
    """Decodes run on the backend's threads, beside the next bucket's encode: neither touches the compressor, and
    the state goes through untouched."""
    comp = TopKCompressor(0.25)
    x = torch.randn(64)
    before = dict(vars(comp))
    payload, state = comp.encode(x, {}, BucketInfo.single(x))
    decode_alone(comp, payload)
    assert state == {} and vars(comp) == before
    assert comp.traits.wire_bytes(BucketInfo.single(x), 4) == payload.nbytes == 16 * 8
    big = BucketInfo.single(torch.zeros(1 << 20))
    assert gcomp.create("topk").compressor.traits.wire_bytes(big, 4) < (1 << 20) // 100 * 6
