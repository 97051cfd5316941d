"""Bit packing and integer lanes: round trips, and the SUM homomorphism that ternary all-reduce relies on."""
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from gcomp.collectives.bitpack import fields_per_word, lane_bits, pack, packed_words, unpack
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
