"""The OCP element formats (8-, 6- and 4-bit floats, OCP Microscaling (MX) v1.0 and OCP 8-bit floating point):
their codes from fp32 (``encode``, round to nearest even or stochastic, saturating) and back (``decode``, a table).

A format with ``e`` exponent bits, ``m`` mantissa bits and bias ``b`` holds, for a code ``S.E.M``, the value
``(-1)^S 2^(E - b) (1 + M / 2^m)`` when ``E > 0`` and ``(-1)^S 2^(1 - b) (M / 2^m)`` when ``E = 0`` (subnormals);
E4M3 gives up its top code ``S.1111.111`` to NaN and has no infinities; E5M2 is IEEE-like (``S.11111.00`` is
infinity, ``S.11111.{01,10,11}`` NaN); E3M2, E2M3 and E2M1 use every code for a number.

The encoders are whole-tensor integer and float operations (no search per element, no host sync). Round to
nearest goes through torch's float8 casts where one holds the format (``cast_codes``: E4M3 and E5M2 as they are,
E2M3 and E3M2 scaled by a power of two onto E4M3's and E5M2's grids, the same codes below the sign); E2M1 adds a
magic number, a power of two whose ulp is the format's step at the entry (``2^(max(E, emin) + 23 - m)``), so that
fp32's own addition rounds to nearest even at the right step, subnormals included, and reads the code off the
sum's bits. Stochastic rounding scales the magnitude so that the format's smallest normal lands on fp32's (its
codes are then exactly the fp32 bit patterns with their low ``23 - m`` bits zero, subnormals too), adds a uniform
integer in ``[0, 2^(23 - m))`` to the bits and truncates: rounded up with probability equal to the distance to
the lower neighbour over the step (exactly, to the resolution of fp32's subnormals, which the scaling must not
flush: ``torch.set_flush_denormal(True)`` breaks it), always to one of the two neighbours. On the CPU the tensor
is taken in slabs of ``SLAB`` entries so that the passes stay in cache (a fixed number of slabs per bucket, none
per block); on a device it is taken whole.
"""
from __future__ import annotations

import difflib
import math
from dataclasses import dataclass

import torch

from gcomp import kernels

SLAB = 1 << 17  # entries per slab on the CPU: the work buffers (fp32, int32, bool) fit a core's L2
_EXPONENT = 0x7F800000


@dataclass(frozen=True)
class Minifloat:
    """One element format: ``ebits`` exponent bits, ``mbits`` mantissa bits, ``bias``; ``max`` its largest finite
    value; ``nan_code`` the code of a positive NaN (``None``: no NaN, a NaN is encoded as ``±max``); ``inf_code``
    that of +infinity (``None``: none)."""

    name: str
    ebits: int
    mbits: int
    bias: int
    max: float
    nan_code: int | None = None
    inf_code: int | None = None
    carrier: str | None = None  # a torch float8 format whose codes hold this one's (see ``cast_codes``)

    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits

    @property
    def emin(self) -> int:
        """The exponent of the smallest normal (``1 - bias``)."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """The exponent of the largest normal (``floor(log2(max))``): MX's ``emax_elem``."""
        return math.frexp(self.max)[1] - 1

    @property
    def min_normal(self) -> float:
        return 2.0 ** self.emin

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (self.emin - self.mbits)

    @property
    def sign_bit(self) -> int:
        return 1 << (self.bits - 1)

    @property
    def nan_fill(self) -> float:
        """The magnitude the encoder gives a NaN before rounding: the NaN code read as if it were a normal number
        (it then rounds to that code), or ``max`` for a format with no NaN."""
        if self.nan_code is None:
            return self.max
        exponent, mantissa = self.nan_code >> self.mbits, self.nan_code & ((1 << self.mbits) - 1)
        return 2.0 ** (exponent - self.bias) * (1 + mantissa / 2 ** self.mbits)


_CARRIERS = {"e4m3": (torch.float8_e4m3fn, -6), "e5m2": (torch.float8_e5m2, -14)}  # dtype, emin


def alignment(fmt: Minifloat) -> float:
    """The power of two that puts ``fmt``'s smallest normal on its carrier's (1 without a carrier): scaled by it,
    ``fmt``'s values are exactly the carrier's up to ``max * alignment``, with the same codes below the sign."""
    return 2.0 ** (_CARRIERS[fmt.carrier][1] - fmt.emin) if fmt.carrier else 1.0


def cast_codes(aligned: torch.Tensor, fmt: Minifloat, out: torch.Tensor, spare: torch.Tensor) -> torch.Tensor:
    """Round to nearest even by torch's float8 cast: the codes of ``aligned`` (fp32 values already multiplied by
    ``alignment(fmt)``; clamped here, in place) written into ``out`` (uint8); ``spare`` is a uint8 buffer of the
    same length. The cast rounds to nearest even, subnormals included; a NaN gives the carrier's NaN code, which
    for a 6-bit format is ±max (the code ``S.11111``... cut to the format's fields)."""
    dtype, _ = _CARRIERS[fmt.carrier]
    top = fmt.max * alignment(fmt)
    out.view(dtype).copy_(aligned.clamp_(-top, top))
    if fmt.bits == 8:
        return out
    # S.EEEEE.MM (or S.EEEE.MMM) -> S.EEE.MM (S.EE.MMM): the value's fields fit the low 5 bits; the sign moves down
    sign = torch.bitwise_right_shift(out, 2, out=spare).bitwise_and_(0x20)
    return out.bitwise_and_(0x1F).bitwise_or_(sign)


FORMATS: dict[str, Minifloat] = {f.name: f for f in (
    Minifloat("e4m3", 4, 3, 7, 448.0, nan_code=0x7F, carrier="e4m3"),
    Minifloat("e5m2", 5, 2, 15, 57344.0, nan_code=0x7F, inf_code=0x7C, carrier="e5m2"),
    Minifloat("e3m2", 3, 2, 3, 28.0, carrier="e5m2"),
    Minifloat("e2m3", 2, 3, 1, 7.5, carrier="e4m3"),
    Minifloat("e2m1", 2, 1, 1, 6.0),
)}


def minifloat(name: str) -> Minifloat:
    """The element format called ``name`` (``e4m3``, ``e5m2``, ``e3m2``, ``e2m3``, ``e2m1``)."""
    found = FORMATS.get(name)
    if found is None:
        close = difflib.get_close_matches(name, FORMATS, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"unknown element format {name!r}{hint} (known: {', '.join(FORMATS)})")
    return found


def _check(fmt: Minifloat | str) -> Minifloat:
    return minifloat(fmt) if isinstance(fmt, str) else fmt


_TABLES: dict[tuple[str, str], torch.Tensor] = {}


def table(fmt: Minifloat | str, device: torch.device | str = "cpu") -> torch.Tensor:
    """The value of every code, fp32, indexed by the code (``2^bits`` entries; kept per format and device)."""
    fmt = _check(fmt)
    key = (fmt.name, str(torch.device(device)))
    found = _TABLES.get(key)
    if found is None:
        codes = torch.arange(1 << fmt.bits)
        exponent = (codes >> fmt.mbits) & ((1 << fmt.ebits) - 1)
        mantissa = (codes & ((1 << fmt.mbits) - 1)).double()
        normal = torch.ldexp(1 + mantissa / 2 ** fmt.mbits, exponent - fmt.bias)
        subnormal = torch.ldexp(mantissa / 2 ** fmt.mbits, torch.full_like(exponent, fmt.emin))
        values = torch.where(exponent > 0, normal, subnormal)
        magnitude = codes & (fmt.sign_bit - 1)
        if fmt.inf_code is not None:
            values[magnitude == fmt.inf_code] = float("inf")
        if fmt.nan_code is not None:
            values[magnitude > fmt.inf_code if fmt.inf_code is not None else magnitude == fmt.nan_code] = float("nan")
        values = torch.where(codes >= fmt.sign_bit, -values, values)
        found = _TABLES[key] = values.float().to(device)
    return found


def in_slabs(device: torch.device) -> bool:
    """Whether a tensor on ``device`` is taken in slabs: on the CPU, but not on the device path (a GPU's, or any
    device's while ``gcomp.kernels.forced``), which takes the tensor whole in a fixed number of operations."""
    return device.type == "cpu" and kernels.forced_kind() is None


def _slabs(n: int, device: torch.device, unit: int = 1, slab: int | None = None):
    """``(start, stop)`` of the slabs a tensor of ``n`` entries is taken in (whole multiples of ``unit``; ``slab``
    entries at most, ``SLAB`` by default)."""
    slab = SLAB if slab is None else slab
    if not in_slabs(device) or n <= slab:
        yield 0, n
        return
    step = max(unit, slab // unit * unit)
    for start in range(0, n, step):
        yield start, min(n, start + step)


class Work:
    """Work buffers of one slab (fp32, and two int32), reused across the slabs of a call."""

    def __init__(self, n: int, device: torch.device):
        self.f = torch.empty(n, dtype=torch.float32, device=device)
        self.i = torch.empty(n, dtype=torch.int32, device=device)
        self.s = torch.empty(n, dtype=torch.int32, device=device)

    def take(self, n: int):
        return self.f[:n], self.i[:n], self.s[:n]


def work_for(n: int, device: torch.device) -> Work:
    return Work(min(n, SLAB) if in_slabs(device) else n, device)


_CONSTANTS: dict[tuple[int, str], torch.Tensor] = {}


def _k(value: int, device: torch.device) -> torch.Tensor:
    """``value`` as a 0-d int32 tensor on ``device`` (kept): an operand that costs no conversion per call."""
    key = (value, str(device))
    found = _CONSTANTS.get(key)
    if found is None:
        found = _CONSTANTS[key] = torch.tensor(value, dtype=torch.int32, device=device)
    return found


def encode_slab(values: torch.Tensor, fmt: Minifloat, out: torch.Tensor, work: Work, rounding: str = "nearest",
                generator: torch.Generator | None = None, nan: bool = True) -> torch.Tensor:
    """The codes of the fp32 ``values`` (one slab, contiguous; left as they were) written into ``out`` (uint8, the
    same length); ``work`` holds the slab's buffers. ``nan=False``: the caller has no use for the codes of NaN
    entries (a block layer whose scale says NaN), which are then some byte."""
    n, device = values.numel(), values.device
    a, bits, sign = work.take(n)
    torch.bitwise_right_shift(values.view(torch.int32), _k(31, device), out=sign)  # -1 for a negative entry, else 0
    torch.abs(values, out=a).clamp_max_(fmt.max)  # saturated
    if nan:
        a.nan_to_num_(nan=fmt.nan_fill)
    shift = 23 - fmt.mbits
    a_bits = a.view(torch.int32)
    if rounding == "nearest":
        # magic = 2^(max(E, emin) + shift): its ulp is the format's step at the entry
        torch.bitwise_and(a_bits, _k(_EXPONENT, device), out=bits)
        bits.clamp_min_(_k((fmt.emin + 127) << 23, device)).add_(_k(shift << 23, device))
        a.add_(bits.view(torch.float32))  # fp32 rounds to nearest even at that step
        # code = sum - magic + (biased E of the magic) << m, the last two as one multiple of magic >> shift
        a_bits.sub_(bits.bitwise_right_shift_(_k(shift, device)), alpha=(1 << shift) - 1)
        out.copy_(a_bits.sub_(sign, alpha=fmt.sign_bit))  # + the sign; mod 256, the constant below takes the rest
        return out.sub_(((fmt.emin + 127 + shift) << fmt.mbits) & 0xFF)
    a.mul_(2.0 ** (-126 - fmt.emin))  # the format's codes = fp32 bits >> shift, subnormals too
    torch.randint(0, 1 << shift, (n,), generator=generator, dtype=torch.int32, device=device, out=bits)
    a_bits.add_(bits).bitwise_right_shift_(_k(shift, device)).sub_(sign, alpha=fmt.sign_bit)
    return out.copy_(a_bits)


def encode(x: torch.Tensor, fmt: Minifloat | str, rounding: str = "nearest",
           generator: torch.Generator | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The codes (uint8, one per entry, flat) of the fp32 tensor ``x`` in ``fmt``.

    ``rounding``: ``"nearest"`` (ties to even) or ``"stochastic"`` (up with probability equal to the distance to
    the lower neighbour over the step: unbiased; the draws, ``23 - m`` bits per entry, come from ``generator`` on
    ``x``'s device, or the default generator when None). Values beyond ``max``, infinities included, saturate to
    ``±max`` (OCP MX v1.0's conversion; for FP8 the saturating cast). A NaN becomes the format's NaN code (with its
    sign) where it has one (E4M3, E5M2); E3M2, E2M3 and E2M1 have none and a NaN becomes ``±max``: the MX block
    layer carries NaN in the block's scale (E8M0 ``0xFF``), so its elements need no NaN. ``-0.0`` keeps its sign.
    """
    fmt = _check(fmt)
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', not {rounding!r}")
    if x.dtype != torch.float32:
        raise ValueError(f"encode takes fp32, not {x.dtype}")
    flat = x.reshape(-1)
    if out is None:
        out = torch.empty(flat.numel(), dtype=torch.uint8, device=x.device)
    work = work_for(flat.numel(), x.device)
    for start, stop in _slabs(flat.numel(), x.device):
        if rounding == "nearest" and fmt.carrier:
            a = torch.mul(flat[start:stop], alignment(fmt), out=work.f[:stop - start])
            cast_codes(a, fmt, out[start:stop], work.s.view(torch.uint8)[:stop - start])
        else:
            encode_slab(flat[start:stop], fmt, out[start:stop], work, rounding, generator)
    return out


def decode(codes: torch.Tensor, fmt: Minifloat | str, out: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 values of ``codes`` (integers in ``[0, 2^bits)``, flat): one gather from ``table(fmt)``."""
    fmt = _check(fmt)
    flat = codes.reshape(-1)
    if out is None:
        out = torch.empty(flat.numel(), dtype=torch.float32, device=codes.device)
    values = table(fmt, codes.device)
    index = torch.empty(min(flat.numel(), SLAB) if in_slabs(codes.device) else flat.numel(),
                        dtype=torch.int32, device=codes.device)
    for start, stop in _slabs(flat.numel(), codes.device):
        chosen = index[:stop - start].copy_(flat[start:stop])
        torch.index_select(values, 0, chosen, out=out[start:stop])
    return out
