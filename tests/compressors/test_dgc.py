"""``dgc``: the warm-up schedule, momentum correction and masking against a plain reference, velocity
conservation (DGC's analogue of error-feedback conservation), the selection (exact top k, also through the
sampled threshold), mostly-zero buckets, non-finite values, clipping, checkpoint and layout moves (old formats
too), the sample offset's stream, no host synchronisation, 4 ranks.

Momentum and velocity are the method's slots: the tests run buckets through ``Method._send`` (compensate, the
slots of the layout, encode) and read the slots from the method's checkpoint."""
from __future__ import annotations

import math

import pytest
import torch

import gcomp
from gcomp import BucketInfo
from gcomp.testing.ops import counting
from tests.compressors.test_randomk import check_convergence

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


class _DGC:
    """A dgc method with the raw wire (int32 positions in selection order), which these tests read tensor by
    tensor: ``compress`` is one bucket through the method's pipeline up to the exchange."""

    def __init__(self, **params):
        self.method = gcomp.create("dgc", **{"positions": "raw", **params})
        self.comp = self.method.compressor

    def __getattr__(self, name):
        return getattr(self.comp, name)

    def __setattr__(self, name, value):
        if name in ("method", "comp"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.comp, name, value)

    def compress(self, x, info):
        return self.method._send(x, info, {"bytes_sent": 0})

    def decompress(self, tensors, ctx):
        return self.comp.decode([t[None] for t in tensors], ctx)

    def state_dict(self):
        return self.method.state_dict()

    def load_state_dict(self, state):
        self.method.load_state_dict(state)


_dgc = _DGC


def _state(comp, info: BucketInfo) -> tuple[torch.Tensor, torch.Tensor]:
    """(momentum, velocity) of a layout, read from the per-parameter checkpoint."""
    state = comp.state_dict()["compressor"]
    return tuple(torch.cat([state[b][name].reshape(-1) for name in info.names]) for b in ("momentum", "velocity"))


def test_density_warm_up_follows_the_paper():
    comp = _dgc(ratio=0.001, warmup_steps=4, warmup_stages=4)
    densities = [comp.density(s) for s in range(6)]
    # the paper's 75%, 93.75%, 98.4375%, 99.6% sparsity, then 99.9%
    assert densities[:4] == pytest.approx([0.25, 0.0625, 0.015625, 0.0039], rel=0.025)
    assert densities[4:] == [0.001, 0.001]
    assert all(a > b for a, b in zip(densities[:5], densities[1:5]))
    slow = _dgc(ratio=0.001, warmup_steps=8, warmup_stages=4)
    assert [slow.density(s) for s in range(8)] == [d for d in densities[:4] for _ in range(2)]
    assert _dgc(ratio=0.01).density(0) == 0.01


def test_warm_up_sends_k_by_the_schedule_counted_per_step():
    comp = _dgc(ratio=0.01, warmup_steps=3, warmup_stages=3)
    infos = [BucketInfo.from_layout(i, torch.float32, [f"p{i}"], [1000]) for i in range(2)]
    for step, k in enumerate([317, 100, 32, 10, 10]):  # densities 0.01 ** (1/4, 2/4, 3/4), then 0.01
        for info in infos:  # both buckets of a step use the step's density
            payload = comp.compress(torch.randn(1000), info)
            assert payload.tensors[0].numel() == k
    assert comp.state_dict()["compressor"]["steps"] == 5
    assert comp.traits.wire_bytes is None  # the warm-up decides
    plain = _dgc(ratio=0.01)
    assert plain.traits.wire_bytes(infos[0], 2) == plain.compress(torch.randn(1000), infos[0]).nbytes == 10 * 8


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("masking", [False, True])
def test_momentum_correction_and_masking_match_a_plain_reference(nesterov, masking):
    m = 0.9
    comp = _dgc(ratio=0.1, momentum=m, nesterov=nesterov, masking=masking)
    info = BucketInfo.from_layout(0, torch.float64, ["w", "b"], [150, 50])
    u = torch.zeros(200, dtype=torch.float64)
    v = torch.zeros(200, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    for step in range(6):
        grad = torch.randn(200, generator=g, dtype=torch.float64)
        if nesterov:
            u = (u + grad) * m
            v = v + u + grad
        else:
            u = m * u + grad
            v = v + u
        payload = comp.compress(grad, info)
        values, index = payload.tensors
        index = index.long()
        assert index.numel() == 20
        assert torch.equal(index.sort().values, torch.topk(v.abs(), 20).indices.sort().values)
        torch.testing.assert_close(values, v[index], rtol=1e-12, atol=0)
        v[index] = 0
        if masking:
            u[index] = 0
        got_u, got_v = _state(comp, info)
        torch.testing.assert_close(got_u, u, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(got_v, v, rtol=1e-12, atol=1e-15)
        if masking:
            assert (got_u[index] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_velocity_conservation_sent_plus_kept_equals_old_plus_corrected_gradient(dtype):
    """DGC's error feedback: what enters the velocity (the momentum-corrected gradient u) is either sent or kept,
    exactly: sent + v_new == v_old + u_new."""
    comp = _dgc(ratio=0.05, masking=False)  # without masking u_new is still readable after the step
    info = BucketInfo.from_layout(0, dtype, ["a", "b"], [700, 100])
    g = torch.Generator().manual_seed(2)
    v_old = torch.zeros(800, dtype=dtype)
    for step in range(5):
        grad = torch.randn(800, generator=g, dtype=torch.float64).to(dtype)
        payload = comp.compress(grad, info)
        sent = comp.decompress(payload.tensors, payload.ctx)
        u_new, v_new = _state(comp, info)
        assert torch.equal(sent + v_new, v_old + u_new), f"step {step}"
        assert (v_new[payload.tensors[1].long()] == 0).all()
        v_old = v_new


@pytest.mark.parametrize("n, ratio", [(100_000, 0.002), (30_000, 0.01), (5_000, 0.05), (300, 0.1)])
def test_selection_is_the_exact_top_k_also_through_the_sampled_threshold(n, ratio):
    """n = 300 takes the exact path; the others estimate the threshold from a strided sample, which yields the
    exact top k whenever between k and 4k entries pass it."""
    k = math.ceil(n * ratio)
    for seed in range(5):
        comp = _dgc(ratio=ratio, momentum=0.0)
        x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * torch.linspace(0.1, 2, n)
        values, index = comp.compress(x.clone(), BucketInfo.single(x)).tensors
        assert index.numel() == k
        assert torch.equal(index.long().sort().values, torch.topk(x.abs(), k).indices.sort().values)
        assert torch.equal(values, x[index.long()])


def test_a_mostly_zero_bucket_sends_every_nonzero_and_pads_with_zeros():
    n, nonzero = 100_000, 50
    x = torch.zeros(n)
    where = torch.randperm(n, generator=torch.Generator().manual_seed(0))[:nonzero]
    x[where] = torch.randn(nonzero).abs() + 1
    comp = _dgc(ratio=0.001, momentum=0.0)  # k = 100 > 50 nonzeros
    payload = comp.compress(x.clone(), BucketInfo.single(x))
    values, index = payload.tensors
    assert values.numel() == 100 and values.count_nonzero() == nonzero
    assert torch.equal(comp.decompress(payload.tensors, payload.ctx), x)
    _, velocity = _state(comp, BucketInfo.single(x))
    assert velocity.count_nonzero() == 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("n", [500, 50_000])
def test_nonfinite_entries_are_sent_and_leave_no_trace_in_the_state(bad, n):
    comp = _dgc(ratio=0.01)
    info = BucketInfo.single(torch.zeros(n))
    x = torch.randn(n) * 100
    x[n // 3] = bad
    payload = comp.compress(x, info)
    assert not torch.isfinite(comp.decompress(payload.tensors, payload.ctx)).all()
    assert all(torch.isfinite(t).all() for t in _state(comp, info))
    payload = comp.compress(torch.randn(n), info)
    assert torch.isfinite(payload.tensors[0]).all()


@pytest.mark.parametrize("world", [1, 4])
def test_local_clipping_per_parameter_scaled_by_the_world_size(world):
    comp = _dgc(ratio=1.0, momentum=0.0, clip_norm=1.0)
    comp.world_size = world  # what bind() sets
    info = BucketInfo.from_layout(0, torch.float64, ["big", "small"], [10, 10])
    local = torch.cat([torch.full((10,), 10.0), torch.full((10,), 0.01)]).double()
    payload = comp.compress(local / world, info)  # the hook hands over g / world
    sent = comp.decompress(payload.tensors, payload.ctx) * world  # back on the local gradient's scale
    limit = 1.0 / math.sqrt(world)  # the paper's N^(-1/2) share of the threshold
    torch.testing.assert_close(sent[:10].norm(), torch.tensor(limit, dtype=torch.float64))
    torch.testing.assert_close(sent[10:], local[10:])


def test_state_moves_to_a_new_layout_and_survives_a_checkpoint():
    comp = _dgc(ratio=0.1, masking=False)
    a = BucketInfo.from_layout(0, torch.float32, ["x", "y"], [40, 60])
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        comp.compress(torch.randn(100, generator=g), a)
    u, v = _state(comp, a)
    state = comp.state_dict()
    fresh = _dgc(ratio=0.1, masking=False)
    fresh.load_state_dict(state)
    b = BucketInfo.from_layout(0, torch.float32, ["y", "x"], [60, 40])  # DDP's rebuild: the same parameters
    u_b = torch.cat([u[40:], u[:40]]) * 0.9  # a zero gradient: u = 0.9 u, v = v + u
    v_b = torch.cat([v[40:], v[:40]]) + u_b
    payloads = []
    for c in (comp, fresh):  # moved live, and moved from the checkpoint
        payload = c.compress(torch.zeros(100), b)
        got_u, got_v = _state(c, b)
        assert torch.equal(got_u, u_b)
        assert torch.equal(got_v + c.decompress(payload.tensors, payload.ctx), v_b)
        payloads.append(payload.tensors)
    assert all(torch.equal(x, y) for x, y in zip(*payloads))
    with pytest.raises(ValueError, match="unexpected"):
        fresh.load_state_dict({**state, "other": 1})


def test_gcomp_0_1_checkpoints_load_and_flush_hands_the_velocity_back():
    comp = _dgc(ratio=0.1, masking=False)
    info = BucketInfo.from_layout(0, torch.float32, ["x", "y"], [40, 60])
    for _ in range(2):
        comp.compress(torch.randn(100), info)
    state = comp.state_dict()
    assert state["compressor"]["generator"] == {"seed": 0, "draws": 0} and state["compressor"]["steps"] == 2
    old = {**state["compressor"], "generator": torch.Generator().get_state()}  # gcomp 0.1's CPU path
    for legacy in (old, {**old, "device_stream": {"seed": 0, "draws": 5}}):  # and its device path
        fresh = _dgc(ratio=0.1, masking=False)
        fresh.load_state_dict({"memory": {}, "compressor": legacy})
        assert fresh.stream.draws == legacy.get("device_stream", {}).get("draws", 0) and fresh.steps == 2
        assert torch.equal(_state(fresh, info)[1], _state(comp, info)[1])
    velocity = _state(comp, info)[1]
    held = comp.method.flush(info, torch.zeros(100))
    assert torch.equal(held, velocity) and all(not t.any() for t in _state(comp, info))
    assert comp.method.flush(BucketInfo.from_layout(1, torch.float32, ["z"], [5]), torch.zeros(5)) is None


def test_the_sample_offset_is_drawn_from_a_stream_the_checkpoint_resumes():
    info = BucketInfo.single(torch.zeros(200_000))  # large enough to sample the threshold
    first = _dgc(ratio=0.001, momentum=0.0)
    for step in range(2):
        first.compress(torch.randn(info.numel, generator=torch.Generator().manual_seed(step)), info)
    state = first.state_dict()
    assert state["compressor"]["generator"]["draws"] == 2
    resumed = _dgc(ratio=0.001, momentum=0.0, seed=7)
    resumed.load_state_dict(state)
    assert resumed.stream.seed == 0
    x = torch.randn(info.numel, generator=torch.Generator().manual_seed(9)) * 1e-3
    with counting() as counter:
        a = first.compress(x.clone(), info)
        b = resumed.compress(x.clone(), info)
    assert counter.syncs == {}
    assert all(torch.equal(s, t) for s, t in zip(a.tensors, b.tensors))


@pytest.mark.parametrize("values", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("ratio", [0.01, 0.4])  # 0.4: the bitmap form
def test_narrow_values_leave_their_rounding_in_the_velocity(values, ratio):
    comp = _dgc(ratio=ratio, momentum=0.0, masking=False, values=values, positions="coded")
    info = BucketInfo.from_layout(0, torch.float32, ["a", "b"], [3000, 77])
    v_old = torch.zeros(info.numel)
    for step in range(3):
        grad = torch.randn(info.numel, generator=torch.Generator().manual_seed(step))
        payload = comp.compress(grad, info)
        sent = comp.decompress(payload.tensors, payload.ctx)
        v_new = _state(comp, info)[1]
        assert torch.equal(sent + v_new, v_old + grad), f"step {step}"
        v_old = v_new


# --- 4 ranks ----------------------------------------------------------------------------------------------------

def test_dgc_lowers_the_loss_on_4_ranks():
    """Bounds (identity, plain SGD, drops 0.88 in 40 steps; DGC's momentum 0.9 lives in the method, so the same
    lr moves further): the paper's recipe at 1% (warm-up, Nesterov, clipping) must drop >= 0.7 (measured 1.50);
    ratio 0.05, sampled threshold on the larger buckets, >= 0.5 (measured 1.10); the default 0.1% >= 0.15
    (measured 0.31: one entry per bucket and step, and the first step dense)."""
    check_convergence([
        ("dgc", {"ratio": 0.01, "warmup_steps": 20, "nesterov": True, "clip_norm": 1.0}, 0.7),
        ("dgc", {"ratio": 0.05}, 0.5),
        ("dgc", {}, 0.15),
    ])
