"""``bitpack_device``: the device path's bit fields are ``bitpack``'s, for every width (hypothesis), summed lanes
included, and its table decode is the CPU path's."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gcomp.collectives import bitpack
from gcomp.collectives import bitpack_device
from gcomp.compressors.terngrad import code_table, unpack_codes
from gcomp.testing.ops import counting


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(1, 63), n=st.integers(1, 300), seed=st.integers(0, 2**31 - 1))
def test_pack_and_unpack_are_bitpacks(bits, n, seed):
    g = torch.Generator().manual_seed(seed)
    top = min(bits, 62)
    values = torch.randint(0, 2**top, (n,), generator=g, dtype=torch.int64)
    if bits == 63:  # the top bit of a 63-bit field too
        values = values * 2 + torch.randint(0, 2, (n,), generator=g)
    words = bitpack_device.pack(values, bits)
    assert torch.equal(words, bitpack.pack(values, bits))
    assert torch.equal(bitpack_device.unpack(words, n, bits), values)
    out = torch.empty(n + 5, dtype=torch.float64)
    assert torch.equal(bitpack_device.unpack(words, n, bits, out=out), values.double())


@settings(max_examples=30, deadline=None)
@given(world=st.integers(1, 1024), n=st.integers(1, 200), seed=st.integers(0, 2**31 - 1))
def test_summed_lanes_unpack_to_the_sums(world, n, seed):
    """Lanes of ``lane_bits(world)`` bits summed over ``world`` ranks (int64, wrapping past the sign bit) unpack to
    each field's sum; ranks beyond the first few send the largest code, the worst case for carries."""
    g = torch.Generator().manual_seed(seed)
    bits = bitpack.lane_bits(world)
    codes = [torch.randint(0, 3, (n,), generator=g, dtype=torch.uint8) for _ in range(min(world, 3))]
    codes += [torch.full((n,), 2, dtype=torch.uint8)] * (world - len(codes))
    total = torch.zeros(bitpack.packed_words(n, bits), dtype=torch.int64)
    for c in codes:
        total += bitpack_device.pack(c, bits)
    assert torch.equal(bitpack_device.unpack(total, n, bits), sum(c.long() for c in codes))


@settings(max_examples=30, deadline=None)
@given(words=st.integers(1, 40), cut=st.integers(0, 31), seed=st.integers(0, 2**31 - 1))
def test_the_table_decode_is_the_cpu_paths(words, cut, seed):
    codes = torch.randint(0, 3, (words * 32,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    packed = bitpack.pack(codes, 2)
    n = words * 32 - cut
    table = code_table("cpu")
    out = torch.empty(words * 32)
    decoded = bitpack_device.table_decode(packed, -(-n // 4), table, out, torch.empty(words * 8, dtype=torch.int32))
    assert torch.equal(decoded[:n], unpack_codes(packed, n, table, torch.empty(words * 32)))


def test_a_few_operations_for_any_width_and_length():
    """No pass per field, no chunk loop: the same operations for 3 and 21 fields a word, 1 K and 1 M entries (the
    shifts of a width are made once, before)."""
    seen = set()
    for bits in (3, 21):
        bitpack_device.shifts(bits, torch.device("cpu"))
        for n in (1 << 10, 1 << 20):
            values = torch.ones(n, dtype=torch.uint8)
            with counting() as counter:
                bitpack_device.unpack(bitpack_device.pack(values, bits), n, bits, dtype=torch.float32)
            assert not counter.syncs
            seen.add(sum(counter.ops.values()))
    assert len(seen) == 1 and seen.pop() <= 16
