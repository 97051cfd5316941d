"""The sparse wire (gcomp.collectives.sparse_wire): coded positions (Elias-Fano or bitmap, the smaller) and narrow
values: exact round trips, sizes by formula (past 2**31 entries without allocating), the chosen form the smaller,
stacks decoded at once, message sets and payload stacks round trip."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gcomp.collectives import sparse_wire as cp
from gcomp.collectives.sparse_wire import SparseWire, narrow, widen


def _ef_bits(n: int, k: int) -> int:
    """Elias-Fano's size from its definition, in floating point (a second derivation of the formula)."""
    low = max(0, math.floor(math.log2(n / k)))
    return k * low + k + math.ceil(n / 2 ** low)


def _draw(n: int, k: int, repeats: bool, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if repeats:
        return torch.randint(0, n, (k,), generator=g)
    return torch.randperm(n, generator=g)[:k]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 5000), density=st.floats(0, 1), repeats=st.booleans(), seed=st.integers(0, 2**16))
def test_positions_round_trip_exactly_at_every_density(n, density, repeats, seed):
    k = round(density * n)
    positions = _draw(n, k, repeats, seed)
    values = torch.randn(k, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    ordered, permuted = cp.sort_pairs(positions, values, n)
    code = cp.encode_positions(ordered, n)
    assert code.dtype == torch.uint8 and code.numel() == cp.coded_bytes(n, k)
    decoded = cp.decode_positions(code, n, k)
    assert torch.equal(decoded, ordered)  # the pairs as sent: values stay beside their positions
    if cp.form(n, k) == cp.ELIAS_FANO:  # the multiset itself, repeats and all, in sorted order
        assert torch.equal(decoded, torch.sort(positions).values)
    else:  # the bitmap: each position once, a repeat's values summed onto it
        distinct = torch.unique(positions)
        assert torch.equal(decoded[:distinct.numel()], distinct) and not decoded[distinct.numel():].any()
        assert not permuted[distinct.numel():].any()
    want = torch.zeros(n, dtype=torch.float64).index_add_(0, positions, values)
    got = torch.zeros(n, dtype=torch.float64).index_add_(0, decoded, permuted)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("n", [1, 8, 9, 1000])
def test_empty_and_full_buckets(n):
    assert cp.coded_bytes(n, 0) == 0 and cp.encode_positions(torch.zeros(0, dtype=torch.int64), n).numel() == 0
    assert cp.decode_positions(torch.zeros(2, 0, dtype=torch.uint8), n, 0).shape == (2, 0)
    full = torch.arange(n)
    assert cp.form(n, n) == (cp.BITMAP if n > 1 else cp.ELIAS_FANO)  # one position: 2 bits against 1, one byte each
    assert torch.equal(cp.decode_positions(cp.encode_positions(full, n), n, n), full)


def test_repeated_position_zero_as_dgc_pads():
    """DGC's empty slots: position 0 with value 0, beside a real position 0, in both forms."""
    for n, k in [(1000, 10), (40, 30)]:
        positions = torch.cat([torch.tensor([0, 7, 3]), torch.zeros(k - 3, dtype=torch.int64)])
        values = torch.cat([torch.tensor([2.0, 1.0, -1.0]), torch.zeros(k - 3)])
        ordered, permuted = cp.sort_pairs(positions, values, n)
        decoded = cp.decode_positions(cp.encode_positions(ordered, n), n, k)
        assert torch.equal(torch.zeros(n).index_add_(0, decoded, permuted),
                           torch.zeros(n).index_add_(0, positions, values))


@pytest.mark.parametrize("n,density", [(3_000_000, 0.01), (1_000_000, 0.3), (1 << 21, 1e-5)])
def test_large_buckets_round_trip(n, density):
    k = max(1, int(n * density))
    positions = torch.sort(_draw(n, k, False, 1)).values
    assert torch.equal(cp.decode_positions(cp.encode_positions(positions, n), n, k), positions)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 2**40), density=st.floats(1e-9, 1))
def test_size_by_formula_past_2_31_and_the_smaller_form_chosen(n, density):
    k = max(1, min(n, round(n * density)))
    ef, bitmap = -(-_ef_bits(n, k) // 8), -(-n // 8)
    assert cp.coded_bytes(n, k) == min(ef, bitmap)
    assert cp.form(n, k) == (cp.BITMAP if bitmap < ef else cp.ELIAS_FANO)
    if cp.form(n, k) == cp.ELIAS_FANO:  # at most 2 + ceil(log2(n / k)) bits a position, plus a byte's rounding
        assert 8 * cp.coded_bytes(n, k) <= k * (2 + max(0, math.log2(n / k))) + 1 + 8


def test_a_stack_of_codes_decodes_at_once():
    n, k = 5000, 40
    stack = [torch.sort(_draw(n, k, r == 1, r)).values for r in range(3)]
    codes = torch.stack([cp.encode_positions(p, n) for p in stack])
    assert torch.equal(cp.decode_positions(codes, n, k), torch.stack(stack))
    with pytest.raises(ValueError, match="bytes"):
        cp.decode_positions(codes[:, 1:], n, k)


def test_bits_per_position_at_ratio_001():
    """The issue's estimate, about log2(1 / 0.01) + 2 bits: 8.6 here, against 32 raw."""
    for n in (1 << 20, 1 << 24):
        assert 8.5 < cp.bits_per_position(n, n // 100) < 8.7


@pytest.mark.parametrize("name", ["bf16", "fp16", "fp8_e4m3"])
def test_narrow_values_decode_to_what_narrow_says(name):
    x = torch.randn(1000, dtype=torch.float64) * 3
    wire, scale, rounded = narrow(x, name)
    assert wire.dtype == torch.uint8 and wire.shape == (1000, 1 if name == "fp8_e4m3" else 2)  # gloo moves bytes
    assert torch.equal(widen(wire, name, scale, torch.float64), rounded)
    assert torch.equal(widen(torch.stack([wire, wire]), name,
                                           None if scale is None else torch.stack([scale, scale]), torch.float64)[1],
                       rounded)
    assert (rounded - x).abs().max() <= x.abs().max() * 2 ** -(3 if name == "fp8_e4m3" else 8)
    if name == "fp8_e4m3":
        amax = x.abs().max().item()
        assert scale.item() == pytest.approx(amax / 448, rel=1e-6)
        assert rounded.abs().max().item() == pytest.approx(amax, rel=1e-6)  # the largest is E4M3's 448 times the scale
    zeros = narrow(torch.zeros(5), name)[2]  # an all-zero payload: a scale of 1, zeros
    assert not zeros.any()


@pytest.mark.parametrize("wire", [SparseWire("coded"), SparseWire("coded", "fp8_e4m3"), SparseWire("raw", "bf16"),
                                  SparseWire("raw")])
def test_message_sets_round_trip(wire):
    n, k, count = 700, 9, 3
    index = torch.stack([torch.randperm(n)[:k] for _ in range(count)])
    values = torch.randn(count, k)
    tensors, ordered, exact, sent = wire.encode(index, values, n)
    sections = wire.sections(n, k, values.dtype, count)
    assert [(t.dtype, t.numel()) for t in tensors] == sections
    assert sum(t.numel() * t.element_size() for t in tensors) == wire.nbytes(n, k, values.dtype, count)
    found, got = wire.decode(tensors, n, k, values.dtype, count)
    assert torch.equal(found, ordered.long()) and torch.equal(got, sent)
    for row in range(count):  # each set's own positions, with its own values
        assert torch.equal(torch.sort(found[row]).values, torch.sort(index[row]).values)
        assert torch.equal(torch.zeros(n).index_add_(0, found[row], exact[row]),
                           torch.zeros(n).index_add_(0, index[row], values[row]))


@pytest.mark.parametrize("wire", [SparseWire("coded"), SparseWire("coded", "fp8_e4m3"), SparseWire("raw", "fp16")])
def test_a_stack_of_payloads_decodes_at_once(wire):
    """Every rank's payload (one set each), gathered on a leading dimension: decoded as each alone."""
    n, k = 5000, 40
    payloads = [wire.encode(torch.randperm(n)[:k][None], torch.randn(1, k), n) for _ in range(3)]
    stack = [torch.stack(ts) for ts in zip(*(p[0] for p in payloads))]
    found, got = wire.decode(stack, n, k, torch.float32)
    assert found.shape == got.shape == (3, 1, k)
    for r, (_, index, _, sent) in enumerate(payloads):
        assert torch.equal(found[r], index) and torch.equal(got[r], sent)


def test_bad_wires_are_refused():
    with pytest.raises(ValueError, match="positions must be one of coded, raw"):
        SparseWire("packed")
    with pytest.raises(ValueError, match="values must be one of fp32, bf16, fp16, fp8_e4m3"):
        SparseWire("raw", "fp64")
