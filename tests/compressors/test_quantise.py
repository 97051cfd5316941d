"""What the stochastic quantisers share (``gcomp.compressors.quantise.rounding``): random streams that cannot replay a
user's small seeds, drawn per rank, checkpointed (old generator states too) and started afresh on a resize; the
stochastic rounding's exact probability; per-segment scales by TernGrad's clipping rule; fields packed a byte at a
time exactly as ``bitpack`` packs them."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gcomp
from gcomp.bucket import segment_scales
from gcomp.collectives import bitpack
from gcomp.compressors.quantise.rounding import pack_fields, stochastic_round, unpack_rows, wire_scale
from gcomp.randomness import stream_seed

TAGS = ("terngrad", "qsgd", "natural", "pactrain", "dgc", "randomk", "powersgd")
METHODS = [("qsgd", {}), ("terngrad", {}), ("terngrad", {"collective": "allreduce"}), ("natural", {})]


def test_streams_are_distinct_and_far_from_small_seeds():
    """Every (seed, tag, rank) of a realistic range gets its own seed, none of them a small integer a user's
    ``torch.Generator().manual_seed(n)`` would take (the old ``seed * 1_000_003 + rank`` gave rank r of seed 0
    the seed r)."""
    seeds = {stream_seed(seed, tag, rank) for seed in range(20) for tag in TAGS for rank in [None, *range(8)]}
    assert len(seeds) == 20 * len(TAGS) * 9
    assert min(seeds) >= 2**32 and max(seeds) < 2**63
    assert stream_seed(0, "dgc", 0) == stream_seed(0, "dgc", 0)  # a pure function: every rank agrees
    assert stream_seed(0, "powersgd", key="fc.weight") != stream_seed(0, "powersgd", key="fc.bias")


@pytest.mark.parametrize(("name", "params"), METHODS)
def test_each_rank_draws_its_own_stream_and_a_resume_draws_on(name, params):
    """Ranks bound alike draw differently; ``state_dict`` loaded into a fresh codec of the same rank draws what the
    running one draws next, bit for bit."""
    x = torch.randn(500, generator=torch.Generator().manual_seed(0))
    info = gcomp.BucketInfo.single(x)
    codecs = [gcomp.create(name, **params).compressor for _ in range(3)]
    for rank, codec in enumerate(codecs):
        codec.stream.bind(rank)
    sent = [_sent(c, x, info) for c in codecs]
    assert not torch.equal(sent[0], sent[1]) and not torch.equal(sent[1], sent[2])
    resumed = gcomp.create(name, **params).compressor
    resumed.stream.bind(2)
    resumed.load_state_dict(codecs[2].state_dict())
    assert codecs[2].state_dict() == {"generator": {"seed": 0, "draws": 1}}
    assert torch.equal(_sent(resumed, x, info), _sent(codecs[2], x, info))


def _sent(codec, x, info) -> torch.Tensor:
    payload, _ = codec.encode(x, {}, info)
    if len(payload.tensors) > 1 and hasattr(codec, "second_round"):
        codec.second_round(payload)
    return torch.cat([t.reshape(-1).view(torch.uint8) for t in payload.tensors])


@pytest.mark.parametrize(("name", "params"), METHODS)
def test_old_generator_states_load_and_a_resize_starts_afresh(name, params):
    """gcomp 0.1 saved ``{"generator": {device: uint8 state}}`` (or one tensor, or ``{}`` after a resize): each loads
    and starts the stream afresh; a wrong one is refused naming the method; ``merge_states`` starts afresh."""
    codec = gcomp.create(name, **params).compressor
    old = torch.Generator().get_state()
    for saved in ({"cpu": old}, old, {}):
        codec.stream.draws = 5
        codec.load_state_dict({"generator": saved})
        assert codec.stream.draws == 0
    with pytest.raises(ValueError, match=rf"{name}.*1-D torch.uint8.*torch.float32"):
        codec.load_state_dict({"generator": {"cpu": torch.zeros(5056)}})
    with pytest.raises(ValueError, match="generator"):
        codec.load_state_dict({})
    with pytest.raises(ValueError, match="'seed' and 'draws'"):
        codec.load_state_dict({"generator": {"seed": 1, "draws": -1}})
    merged = codec.merge_states([codec.state_dict()], [codec.state_dict()] * 2, 0)
    codec.stream.draws = 5
    codec.load_state_dict(merged)
    assert codec.stream.draws == 0 and not codec.replicated


@pytest.mark.parametrize("z", [0.0, 0.25, -0.25, 0.5 + 2.0**-10, -1.0 + 2.0**-12, -1.5, 3.75, -126.5])
def test_stochastic_rounding_rounds_up_with_probability_equal_to_the_fractional_part(z):
    """``floor(z + u)`` is ``floor(z)`` or ``floor(z) + 1``, the latter with frequency ``frac(z)`` (within 6 sigma
    over 2^20 draws)."""
    n = 1 << 20
    out = stochastic_round(torch.full((n,), z), torch.Generator().manual_seed(3))
    low, p = math.floor(z), z - math.floor(z)
    assert set(out.unique().tolist()) <= {low, low + 1.0}
    ups = int((out == low + 1).sum())
    assert abs(ups - n * p) <= 6 * math.sqrt(n * p * (1 - p)) + 1


@pytest.mark.parametrize("clip", [0.0, 2.5, math.inf])
def test_segment_scales_cap_at_clip_std_only_where_the_cap_is_positive(clip):
    values = torch.tensor([1.0, -3.0, 0.5, 7.0, -2.0, 4.0, 4.0, -10.0])
    lengths = (6, 1, 0, 1)  # a one-entry segment has std 0; an empty one gives 0
    scales = segment_scales(values, lengths, clip)
    first = values[:6]
    expected = first.abs().max()
    if 0 < clip < math.inf:
        expected = torch.minimum(expected, clip * first.std(correction=0))
    torch.testing.assert_close(scales, torch.stack([expected, torch.tensor(4.0), torch.tensor(0.0),
                                                    torch.tensor(10.0)]))


def test_fp64_scale_is_rounded_up_to_fp32():
    x = torch.tensor([1.0 + 2.0**-40, 0.5], dtype=torch.float64)
    assert wire_scale(x).double()[0] > x[0] and wire_scale(x)[1] == 0.5
    assert wire_scale(torch.tensor([float("nan")], dtype=torch.float64)).isnan().all()


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 300), bits=st.sampled_from([1, 2, 3, 4, 5, 8, 12, 16]), rows=st.integers(1, 4),
       seed=st.integers(0, 2**31 - 1))
def test_fields_pack_as_bitpack_packs_them_and_unpack_row_by_row(n, bits, rows, seed):
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 1 << bits, (rows, n), generator=g)
    packed = [pack_fields(v.to(torch.uint8 if bits <= 8 else torch.int64), bits) for v in values]
    for v, p in zip(values, packed):
        assert torch.equal(p, bitpack.pack(v, bits))
    assert torch.equal(unpack_rows(torch.stack(packed), n, bits).long(), values)
