"""``gcomp.compressors.blockfloat.formats`` against the formats' definitions, block by block in plain Python
(``minifloat_reference`` for the elements): scale selection (fp32 amax / max, OCP MX's E8M0, NVFP4's two levels),
the codes, the decode (and the encode's own), the packed FP6/FP4 bytes, the exact wire size, NaN and infinity,
stochastic rounding, rows encoded together as each alone."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gcomp.compressors.blockfloat import minifloat
from gcomp.compressors.blockfloat.formats import NAMES, block_format, pack, unpack
from tests.compressors.minifloat_reference import REFERENCES, fp32

ELEMENT = {"fp8_e4m3": "e4m3", "fp8_e5m2": "e5m2", "mxfp8_e4m3": "e4m3", "mxfp8_e5m2": "e5m2",
           "mxfp6_e3m2": "e3m2", "mxfp6_e2m3": "e2m3", "mxfp4": "e2m1", "nvfp4": "e2m1"}
EMAX = {"e4m3": 8, "e5m2": 15, "e3m2": 4, "e2m3": 2, "e2m1": 2}


def _mx_scale(block: list[float], element: str) -> int:
    """OCP MX v1.0: ``X = 2^(floor(log2(amax)) - emax_elem)``, E8M0-clamped; NaN (or an infinity) -> 0xFF."""
    if any(math.isnan(v) or math.isinf(v) for v in block):
        return 0xFF
    amax = max(abs(v) for v in block)
    if amax == 0:
        return 0  # log2(0) = -inf, clamped to the least scale 2^-127
    shared = math.frexp(amax)[1] - 1 - EMAX[element]
    return min(max(shared, -127), 127) + 127


def reference(name: str, x: list[float], block: int = 128):
    """``(codes, scales, decoded)`` of ``x`` by the definitions: one code per entry (unpacked), the scales as sent,
    the decoded fp32 values."""
    element = REFERENCES[ELEMENT[name]]
    size = {"nvfp4": 16}.get(name, 32 if name.startswith("mx") else block)
    blocks = [x[i:i + size] for i in range(0, len(x), size)]
    codes, scales, decoded = [], [], []
    if name.startswith("fp8"):
        for b in blocks:
            finite = all(map(math.isfinite, b))
            scale = fp32(max(abs(v) for v in b) / float(element.max)) if finite else math.nan
            divisor = scale if scale != 0 else 1.0
            cs = [element.encode(fp32(v / divisor)) if not math.isnan(divisor) else None for v in b]
            codes += cs
            scales.append(scale)
            decoded += [fp32(element.value(c) * scale) if c is not None else math.nan for c in cs]
        return codes, scales, decoded
    if name.startswith("mx"):
        for b in blocks:
            s = _mx_scale(b, element.name)
            cs = [None if s == 0xFF else element.encode(fp32(v * 2.0 ** (127 - s))) for v in b]
            codes += cs
            scales.append(s)
            decoded += [math.nan if c is None else fp32(element.value(c) * 2.0 ** (s - 127)) for c in cs]
        return codes, scales, decoded
    e4m3 = REFERENCES["e4m3"]
    finite = [abs(v) for v in x if math.isfinite(v)]
    glob = fp32(max(finite, default=0.0) / (6 * 448))
    for b in blocks:
        bad = any(not math.isfinite(v) for v in b)
        amax = max(abs(v) for v in b) if not bad else 0.0
        ratio = math.nan if bad else fp32(fp32(amax / 6) / glob) if glob > 0 else 0.0
        s = e4m3.encode(ratio)
        divisor = fp32(e4m3.value(s) * glob)
        cs = [None if bad else element.encode(fp32(v / (divisor if divisor != 0 else 1.0))) for v in b]
        codes += cs
        scales.append(s)
        decoded += [math.nan if c is None else fp32(element.value(c) * divisor) for c in cs]
    return codes, (scales, glob), decoded


def _same(got: list[float], want: list[float]) -> bool:
    return all((math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
               for a, b in zip(got, want, strict=True))


def _encode(fmt, x: torch.Tensor, *args) -> list[torch.Tensor]:
    """``x`` encoded as one row, its tensors flat."""
    return [t.view(-1) for t in fmt.encode(x.view(1, -1), *args)[0]]


def _decode(fmt, tensors: list[torch.Tensor], n: int) -> torch.Tensor:
    return fmt.decode([t.view(1, -1) for t in tensors], n).view(-1)


def _check(name: str, x: list[float], block: int = 128) -> list[torch.Tensor]:
    fmt = block_format(name, block if name.startswith("fp8") else None)
    wire, own = fmt.encode(torch.tensor(x, dtype=torch.float32).view(1, -1), decoded=True)
    tensors = [t.view(-1) for t in wire]
    codes, scales, decoded = reference(name, [fp32(v) for v in x], block)
    got = unpack(wire[0], fmt.element_bits, len(x)).view(-1).tolist()
    assert [g for g, c in zip(got, codes) if c is not None] == [c for c in codes if c is not None]
    if name.startswith("fp8"):
        assert _same(tensors[1].tolist(), scales)
    elif name.startswith("mx"):
        assert tensors[1].tolist() == scales
    else:
        assert tensors[1].tolist() == scales[0] and tensors[2].tolist() == [scales[1]]
    assert _same(fmt.decode(wire, len(x)).view(-1).tolist(), decoded)
    assert _same(own.view(-1).tolist(), decoded)  # the encode's own decode, which error feedback reads
    assert sum(t.numel() * t.element_size() for t in tensors) == fmt.wire_bytes(len(x))
    return tensors


VALUE = st.one_of(st.floats(-1e4, 1e4, width=32), st.floats(width=32, allow_nan=False, allow_infinity=False),
                  st.sampled_from([0.0, -0.0, 1e-40, 448.0, 6.0, 5.0, 0.25, 3e38]))


@settings(max_examples=40, deadline=None)
@given(data=st.data(), name=st.sampled_from(NAMES))
def test_encode_and_decode_match_the_definitions(data, name):
    size = 8 if name.startswith("fp8") else {"nvfp4": 16}.get(name, 32)
    blocks = data.draw(st.integers(1, 3))
    x = data.draw(st.lists(VALUE, min_size=size * blocks, max_size=size * blocks))
    _check(name, x, block=8)


@pytest.mark.parametrize("name", NAMES)
def test_nan_and_infinity_blocks_decode_to_nan_and_no_further(name):
    size = 128 if name.startswith("fp8") else {"nvfp4": 16}.get(name, 32)
    x = [float(i % 7) - 3 for i in range(4 * size)]
    x[1], x[2 * size + 3] = math.nan, -math.inf
    tensors = _check(name, x)
    y = _decode(block_format(name), tensors, len(x))
    assert y.view(4, size).isnan().all(1).tolist() == [True, False, True, False]
    if name.startswith("mx"):
        assert tensors[1].tolist() == [0xFF, tensors[1][1].item(), 0xFF, tensors[1][3].item()]


@pytest.mark.parametrize("element, amax, code", [
    ("mxfp4", 4.0, 127),  # a power of two: floor(log2 4) = 2 = emax -> X = 1
    ("mxfp4", fp32(3.9999998), 126),  # just below: floor(log2) = 1 -> X = 1/2 (and 3.99.. * 2 saturates to 6)
    ("mxfp8_e4m3", 256.0, 127), ("mxfp8_e4m3", 1.0, 119), ("mxfp8_e5m2", 1.0, 112), ("mxfp6_e3m2", 1.0, 123),
    ("mxfp6_e2m3", 2.0 ** -130, 0), ("mxfp4", 3e38, 252), ("mxfp4", 0.0, 0),
])
def test_e8m0_scale_selection(element, amax, code):
    x = [0.0] * 32
    x[5] = amax
    fmt = block_format(element)
    tensors = _encode(fmt, torch.tensor(x))
    assert tensors[1].tolist() == [code]
    _check(element, x)
    if amax == fp32(3.9999998):
        assert _decode(fmt, tensors, 32)[5].item() == 3.0  # 7.9999996 saturates to 6, times 1/2
    if amax == 0:
        assert not _decode(fmt, tensors, 32).any()


def test_a_zero_fp8_block_has_scale_zero_and_decodes_to_zeros():
    x = torch.zeros(256)
    x[200] = -3.0
    fmt = block_format("fp8_e4m3")
    tensors = _encode(fmt, x)
    assert tensors[1].tolist() == [0.0, fp32(3.0 / 448)]
    assert torch.equal(_decode(fmt, tensors, 256), x)  # 448 * (3 / 448) is 3 again


def test_nvfp4_two_level_scale():
    x = torch.zeros(64)
    x[:16] = torch.linspace(-2688.0, 2688.0, 16)  # the tensor's amax: global = 2688 / (6 * 448) = 1
    x[16:32] = 0.75  # block amax 0.75: scale 0.75 / 6 = 0.125, an E4M3 value
    x[32:48] = 1e-9  # too small for an E4M3 scale (< 2^-10): scale code 0, decodes to zeros
    tensors = _check("nvfp4", x.tolist())
    assert tensors[2].tolist() == [1.0]
    assert tensors[1].tolist()[:4] == [0x7E, 0x20, 0, 0]  # 448 = S.1111.110, 0.125 = S.0100.000
    nvfp4 = block_format("nvfp4")
    y = _decode(nvfp4, tensors, 64)
    assert y[0].item() == -2688.0 and torch.equal(y[16:32], x[16:32]) and not y[32:].any()
    assert not _decode(nvfp4, _encode(nvfp4, torch.zeros(32)), 32).any()


@settings(max_examples=30, deadline=None)
@given(codes=st.lists(st.integers(0, 63), min_size=4, max_size=64).filter(lambda c: len(c) % 4 == 0),
       bits=st.sampled_from([4, 6]))
def test_packed_codes_round_trip_in_the_documented_layout(codes, bits):
    codes = [c & ((1 << bits) - 1) for c in codes]
    n = len(codes)
    packed = pack(torch.tensor(codes, dtype=torch.uint8).view(1, n), bits)
    assert packed.shape == (1, n * bits // 8)
    raw = packed.view(-1).tolist()
    low = [(raw[i // 2] >> 4 * (i % 2)) & 15 for i in range(n)]
    high = [(raw[n // 2 + i // 4] >> 2 * (i % 4)) & 3 for i in range(n)] if bits == 6 else [0] * n
    assert [lo | hi << 4 for lo, hi in zip(low, high)] == codes
    assert unpack(packed, bits, n).view(-1).tolist() == codes


@pytest.mark.parametrize("name, bits, n, size", [
    ("fp8_e4m3", 8.25, 1024, 1024 + 4 * 8), ("fp8_e5m2", 8.25, 128, 128 + 4),
    ("mxfp8_e4m3", 8.25, 64, 64 + 2), ("mxfp6_e3m2", 6.25, 64, 48 + 2), ("mxfp6_e2m3", 6.25, 32, 24 + 1),
    ("mxfp4", 4.25, 64, 32 + 2), ("nvfp4", 4.5, 64, 32 + 4 + 4),
])
def test_wire_bytes(name, bits, n, size):
    fmt = block_format(name)
    assert fmt.bits_per_entry == bits and fmt.wire_bytes(n) == size
    tensors, _ = fmt.encode(torch.randn(3, n))
    assert all(t.dim() == 2 and t.shape[0] == 3 for t in tensors)
    assert sum(t.numel() * t.element_size() for t in tensors) == 3 * size


def test_stochastic_block_rounding_is_unbiased_and_picks_neighbours():
    """mxfp4, a block of amax 6 (scale 1) holding 1.3 (neighbours 1 and 1.5): 31,000 draws, a 5-standard-error
    bound on the mean (see test_minifloat's unbiasedness test)."""
    x = torch.full((1000, 32), 1.3)
    x[:, 0] = 6.0
    fmt = block_format("mxfp4")
    y = fmt.decode(fmt.encode(x, "stochastic", torch.Generator().manual_seed(5))[0], 32)
    drawn = y[:, 1:].double()
    assert set(drawn.unique().tolist()) == {1.0, 1.5}
    n, p = drawn.numel(), fp32(1.3) / 0.5 - 2
    assert abs(drawn.mean().item() - fp32(1.3)) < 5 * 0.5 * math.sqrt(p * (1 - p) / n)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_rows_encode_together_as_each_alone(name, rounding):
    """Rows of chunks at once (a block's scale, NVFP4's global scale per row, the packing): to nearest, each row as
    if encoded alone; either way, the encode's own decode is the decode of its wire."""
    fmt = block_format(name)
    x = torch.randn(4, fmt.block * 5, generator=torch.Generator().manual_seed(2))
    x *= torch.tensor([[1e-3], [1.0], [1e3], [0.0]])
    x[1, 7] = float("nan")
    together, decoded = fmt.encode(x, rounding, torch.Generator().manual_seed(4), decoded=True)
    assert torch.equal(fmt.decode(together, x.shape[1]).nan_to_num(), decoded.nan_to_num())
    assert decoded[1].isnan().any() and not decoded[[0, 2]].isnan().any() and not decoded[3].any()
    for r in range(4 if rounding == "nearest" else 0):
        alone, own = fmt.encode(x[r:r + 1], decoded=True)
        assert all(torch.equal(a[0].view(torch.uint8), t[r].view(torch.uint8)) for a, t in zip(alone, together))
        assert torch.equal(own[0].nan_to_num(), decoded[r].nan_to_num())


@pytest.mark.parametrize("name", NAMES)
def test_an_empty_tensor_has_only_its_fixed_scales(name):
    fmt = block_format(name)
    tensors, _ = fmt.encode(torch.empty(1, 0))
    assert sum(t.numel() * t.element_size() for t in tensors) == fmt.wire_bytes(0) == (4 if name == "nvfp4" else 0)
    assert fmt.decode(tensors, 0).numel() == 0


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="did you mean mxfp4"):
        block_format("mxfp4x")
    with pytest.raises(ValueError, match="32"):
        block_format("mxfp4", block=64)
    with pytest.raises(ValueError, match="multiple"):
        block_format("mxfp4").encode(torch.ones(1, 33))
    with pytest.raises(ValueError, match="multiple"):
        block_format("nvfp4").wire_bytes(8)
    with pytest.raises(ValueError, match="block"):
        block_format("fp8_e4m3", block=6)
    with pytest.raises(ValueError, match="rounding"):
        block_format("fp8_e5m2").encode(torch.ones(1, 128), rounding="up")
    with pytest.raises(ValueError, match="rows"):
        block_format("fp8_e5m2").encode(torch.ones(128))


def test_e4m3_scale_values_are_torchs_float8_cast():
    codes = torch.arange(256, dtype=torch.uint8)
    got, cast = minifloat.decode(codes, "e4m3"), codes.view(torch.float8_e4m3fn).float()
    assert torch.equal(got.isnan(), cast.isnan()) and got.isnan().sum() == 2
    assert torch.equal(got.nan_to_num(), cast.nan_to_num()) and torch.equal(got.signbit(), cast.signbit())
