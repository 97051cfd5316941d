"""Bit packing and integer lanes: round trips, and the SUM homomorphism that ternary all-reduce relies on."""
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from gcomp.collectives.bitpack import (bit_table, fields_per_word, lane_bits, pack, pack_flags_, packed_words, unpack,
                                        unpack_table)
from tests.distributed import run_ranks

SETTINGS = settings(max_examples=60, deadline=None)


@SETTINGS
@given(bits=st.integers(1, 63), n=st.integers(0, 300), seed=st.integers(0, 2**31 - 1))
def test_pack_unpack_round_trip(bits, n, seed):
    g = torch.Generator().manual_seed(seed)
    high = min(2**bits, 2**62)  # randint's bound; the widest fields get values up to 2**62 - 1
    values = torch.randint(0, high, (n,), generator=g, dtype=torch.int64)
    if bits < 63 and n:
        values[0] = 2**bits - 1  # the largest value a field holds, sign bit included for the top field
    original = values.clone()
    words = pack(values, bits)
    assert torch.equal(values, original), "pack wrote to its input"
    assert words.dtype == torch.int64 and words.numel() == packed_words(n, bits)
    assert torch.equal(unpack(words, n, bits), values)


@SETTINGS
@given(world=st.integers(1, 1024), n=st.integers(1, 120), seed=st.integers(0, 2**31 - 1))
def test_unpack_of_summed_lanes_is_the_sum_of_ternary_codes(world, n, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-1, 2, (world, n), generator=g)
    codes[:, 0] = 1  # the extreme field sum 2N must not carry into the next field
    bits = lane_bits(world)
    packed = torch.stack([pack((t + 1).to(torch.uint8), bits) for t in codes])
    assert torch.equal(unpack(packed.sum(0), n, bits) - world, codes.sum(0))


@pytest.mark.parametrize("world, bits", [(1, 2), (2, 3), (4, 4), (5, 4), (8, 5), (1024, 12)])
def test_lane_width_is_the_narrowest_that_holds_2n(world, bits):
    assert lane_bits(world) == bits
    assert 2 * world < 2**bits and (bits == 1 or 2 * world >= 2 ** (bits - 1))


def test_bad_widths_are_clear_errors():
    with pytest.raises(ValueError, match="bits"):
        fields_per_word(0)
    with pytest.raises(ValueError, match="bits"):
        fields_per_word(64)
    with pytest.raises(ValueError, match="world_size"):
        lane_bits(0)
    with pytest.raises(ValueError, match="cannot hold"):
        unpack(torch.zeros(1, dtype=torch.int64), 33, 2)


def _allreduce_lanes(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    world, rank = dist.get_world_size(), dist.get_rank()
    codes = torch.randint(-1, 2, (world, n), generator=torch.Generator().manual_seed(7))
    codes[:, -1] = 1  # every rank puts 2 into the top field of the last word: its sum uses the sign bit
    bits = lane_bits(world)
    words = pack((codes[rank] + 1).to(torch.uint8), bits)
    dist.all_reduce(words)
    return unpack(words, n, bits) - world, codes.sum(0)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_gloo_int64_sum_of_lanes_decodes_exactly(world):
    n = 16 * fields_per_word(lane_bits(world))  # whole words, so the last field is the top one
    for decoded, expected in run_ranks(world, _allreduce_lanes, n):
        assert torch.equal(decoded, expected)


# --- the one-bit fast paths ----------------------------------------------------------------------------------

@SETTINGS
@given(n=st.integers(0, 700), seed=st.integers(0, 2**31 - 1), as_bool=st.booleans())
def test_pack_flags_lays_bits_out_as_pack_does(n, seed, as_bool):
    flags = torch.rand(n, generator=torch.Generator().manual_seed(seed)) < 0.5
    flags = flags if as_bool else flags.to(torch.uint8)
    expected = pack(flags.to(torch.int64), 1)
    assert torch.equal(pack_flags_(flags.clone()), expected)
    out = torch.full((packed_words(n, 1),), -1, dtype=torch.int64)  # padding bits are written, not left
    assert pack_flags_(flags.clone(), out=out) is out and torch.equal(out, expected)


@SETTINGS
@given(n=st.integers(0, 700), seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from(
    [torch.float32, torch.float16, torch.float64, torch.int32, torch.uint8]))
def test_unpack_table_reads_each_bit_through_the_table(n, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    bits = torch.rand(n, generator=g) < 0.5
    words = pack(bits, 1)
    zero, one = (torch.randint(0, 100, (1, 8), generator=g).to(dtype) for _ in range(2))  # per position
    out = unpack_table(words, n, bit_table(zero, one))
    positions = torch.arange(n) % 8
    assert out.dtype == dtype and torch.equal(out, torch.where(bits, one[0, positions], zero[0, positions]))
    assert torch.equal(unpack(words, n, 1, dtype=dtype), bits.to(dtype))  # unpack's 1-bit path uses it


@SETTINGS
@given(n=st.integers(1, 300), seed=st.integers(0, 2**31 - 1), tables=st.integers(1, 4))
def test_unpack_table_base_picks_a_table_per_byte(n, seed, tables):
    g = torch.Generator().manual_seed(seed)
    bits = torch.rand(n, generator=g) < 0.5
    values = torch.randn(tables, 2, generator=g)
    stacked = bit_table(values[:, 0, None, None], values[:, 1, None, None]).view(-1, 8)  # (tables * 256, 8)
    which = torch.randint(0, tables, (-(-n // 8),), generator=g)
    out = unpack_table(pack(bits, 1), n, stacked, base=(which * 256).to(torch.int32))
    per_entry = values[which.repeat_interleave(8)[:n]]
    assert torch.equal(out, torch.where(bits, per_entry[:, 1], per_entry[:, 0]))
