"""The OCP element formats (8-, 6- and 4-bit floats, OCP Microscaling (MX) v1.0 and OCP 8-bit floating point):
their codes from fp32 (``encode``, round to nearest even or stochastic, saturating) and back (``decode``, a table).

A format with ``e`` exponent bits, ``m`` mantissa bits and bias ``b`` holds, for a code ``S.E.M``, the value
``(-1)^S 2^(E - b) (1 + M / 2^m)`` when ``E > 0`` and ``(-1)^S 2^(1 - b) (M / 2^m)`` when ``E = 0`` (subnormals);
E4M3 gives up its top code ``S.1111.111`` to NaN and has no infinities; E5M2 is IEEE-like (``S.11111.00`` is
infinity, ``S.11111.{01,10,11}`` NaN); E3M2, E2M3 and E2M1 use every code for a number.

The encoders are whole-tensor integer and float operations (no search per element, no host sync). Round to
nearest goes through torch's float8 casts where one holds the format (``cast_codes``); E2M1 adds a magic number, a
power of two whose ulp is the format's step at the entry (``2^(max(E, emin) + 23 - m)``), so that fp32's own
addition rounds to nearest even at the right step, subnormals included, and reads the code off the sum's bits.
Stochastic rounding scales the magnitude so that the format's smallest normal lands on fp32's (its codes are then
the fp32 bit patterns with their low ``23 - m`` bits zero, subnormals too), adds a uniform integer in
``[0, 2^(23 - m))`` to the bits and truncates: up with probability equal to the distance to the lower neighbour
over the step (to the resolution of fp32's subnormals, which the scaling must not flush:
``torch.set_flush_denormal(True)`` breaks it), always to one of the two neighbours.
"""
from __future__ import annotations

import difflib
import math
from dataclasses import dataclass

import torch

ROUNDINGS = ("nearest", "stochastic")


@dataclass(frozen=True)
class Minifloat:
    """One element format: ``ebits`` exponent bits, ``mbits`` mantissa bits, ``bias``; ``max`` its largest finite
    value; ``nan_code`` the code of a positive NaN (None: no NaN, a NaN is encoded as ``±max``); ``inf_code``
    that of +infinity (None: none); ``carrier``, a torch float8 format whose codes hold this one's."""

    name: str
    ebits: int
    mbits: int
    bias: int
    max: float
    nan_code: int | None = None
    inf_code: int | None = None
    carrier: str | None = None

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
        """The magnitude a NaN takes before rounding: the NaN code read as a normal number (it rounds to that code),
        or ``max`` for a format with no NaN."""
        if self.nan_code is None:
            return self.max
        exponent, mantissa = self.nan_code >> self.mbits, self.nan_code & ((1 << self.mbits) - 1)
        return 2.0 ** (exponent - self.bias) * (1 + mantissa / 2 ** self.mbits)


_CARRIERS = {"e4m3": (torch.float8_e4m3fn, -6), "e5m2": (torch.float8_e5m2, -14)}  # dtype, emin

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


def alignment(fmt: Minifloat) -> float:
    """The power of two that puts ``fmt``'s smallest normal on its carrier's (1 without a carrier): scaled by it,
    ``fmt``'s values are exactly the carrier's up to ``max * alignment``, with the same codes below the sign."""
    return 2.0 ** (_CARRIERS[fmt.carrier][1] - fmt.emin) if fmt.carrier else 1.0


def cast_codes(aligned: torch.Tensor, fmt: Minifloat) -> torch.Tensor:
    """Round to nearest even by torch's float8 cast: the uint8 codes of ``aligned`` (fp32 values already multiplied
    by ``alignment(fmt)``; clamped here, in place). A NaN gives the carrier's NaN code, which for a 6-bit format is
    ±max (the code ``S.11111``... cut to the format's fields)."""
    top = fmt.max * alignment(fmt)
    codes = aligned.clamp_(-top, top).to(_CARRIERS[fmt.carrier][0]).view(torch.uint8)
    if fmt.bits == 8:
        return codes
    # S.EEEEE.MM (or S.EEEE.MMM) -> S.EEE.MM (S.EE.MMM): the value's fields fit the low 5 bits; the sign moves down
    sign = codes.bitwise_right_shift(2).bitwise_and_(0x20)
    return codes.bitwise_and_(0x1F).bitwise_or_(sign)


def table(fmt: Minifloat | str, device: torch.device | str = "cpu") -> torch.Tensor:
    """The value of every code, fp32, indexed by the code (``2^bits`` entries; kept per format and device)."""
    fmt = minifloat(fmt) if isinstance(fmt, str) else fmt
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


_TABLES: dict[tuple[str, str], torch.Tensor] = {}


def encode(x: torch.Tensor, fmt: Minifloat | str, rounding: str = "nearest",
           generator: torch.Generator | None = None) -> torch.Tensor:
    """The codes (uint8, one per entry, of ``x``'s shape) of the fp32 tensor ``x`` in ``fmt``.

    ``rounding``: ``"nearest"`` (ties to even) or ``"stochastic"`` (up with probability equal to the distance to
    the lower neighbour over the step: unbiased; ``23 - m`` random bits per entry from ``generator``, on ``x``'s
    device). Values beyond ``max``, infinities included, saturate to ``±max`` (OCP MX v1.0's conversion; for FP8 the
    saturating cast). A NaN becomes the format's NaN code (with its sign) where it has one (E4M3, E5M2), else
    ``±max``: the MX block layer carries NaN in the block's scale. ``-0.0`` keeps its sign."""
    fmt = minifloat(fmt) if isinstance(fmt, str) else fmt
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', not {rounding!r}")
    if x.dtype != torch.float32:
        raise ValueError(f"encode takes fp32, not {x.dtype}")
    if rounding == "nearest" and fmt.carrier:
        return cast_codes(x * alignment(fmt), fmt)
    sign = x.view(torch.int32).bitwise_right_shift(31)  # -1 for a negative entry, else 0
    a = x.abs().clamp_max_(fmt.max).nan_to_num_(nan=fmt.nan_fill)  # saturated
    bits, shift = a.view(torch.int32), 23 - fmt.mbits
    if rounding == "nearest":
        # magic = 2^(max(E, emin) + shift): its ulp is the format's step at the entry
        magic = bits.bitwise_and(0x7F800000).clamp_min_((fmt.emin + 127) << 23).add_(shift << 23)
        a.add_(magic.view(torch.float32))  # fp32 rounds to nearest even at that step
        # code = sum - magic + (biased E of the magic) << m, the last two as one multiple of magic >> shift
        bits.sub_(magic.bitwise_right_shift_(shift), alpha=(1 << shift) - 1)
        # + the sign; mod 256, the constant takes the rest
        return bits.sub_(sign, alpha=fmt.sign_bit).to(torch.uint8).sub_(((fmt.emin + 127 + shift) << fmt.mbits) & 0xFF)
    a.mul_(2.0 ** (-126 - fmt.emin))  # the format's codes = fp32 bits >> shift, subnormals too
    noise = torch.randint(0, 1 << shift, a.shape, generator=generator, dtype=torch.int32, device=a.device)
    return bits.add_(noise).bitwise_right_shift_(shift).sub_(sign, alpha=fmt.sign_bit).to(torch.uint8)


def decode(codes: torch.Tensor, fmt: Minifloat | str) -> torch.Tensor:
    """The fp32 values of ``codes`` (integers in ``[0, 2^bits)``): one gather from ``table(fmt)``."""
    values = table(fmt, codes.device)
    return torch.index_select(values, 0, codes.reshape(-1).to(torch.int32)).view(codes.shape)
