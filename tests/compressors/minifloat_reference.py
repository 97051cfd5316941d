"""The element formats written out from their definitions (OCP 8-bit floating point and OCP Microscaling v1.0), in
plain Python with exact fractions: every code's value from its sign, exponent and mantissa, and the code of a
number by a search over those values (nearest, ties to the even code; saturating). The tests hold
``gcomp.compressors.blockfloat.minifloat`` and ``.formats`` to it; nothing here uses them."""
from __future__ import annotations

import bisect
import math
import struct
from fractions import Fraction

# name: (exponent bits, mantissa bits, bias, specials) -- "fn": S.1111.111 is NaN, no infinities;
# "ieee": the top exponent holds infinity (mantissa 0) and NaN; None: every code is a number
SPEC = {
    "e4m3": (4, 3, 7, "fn"),
    "e5m2": (5, 2, 15, "ieee"),
    "e3m2": (3, 2, 3, None),
    "e2m3": (2, 3, 1, None),
    "e2m1": (2, 1, 1, None),
}


def fp32(value: float) -> float:
    """``value`` rounded to fp32 (to nearest even), as a Python float."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def fp32_step(value: float, steps: int) -> float:
    """The fp32 number ``steps`` fp32 numbers above the positive fp32 ``value``."""
    return struct.unpack("<f", struct.pack("<I", struct.unpack("<I", struct.pack("<f", value))[0] + steps))[0]


class Reference:
    """One format: ``value(code)`` (a float; NaN or ±inf for the specials), ``encode(x, sign)`` of an exact
    number, ``neighbours(x)`` for stochastic rounding."""

    def __init__(self, name: str):
        self.name = name
        self.ebits, self.mbits, self.bias, self.specials = SPEC[name]
        self.bits = 1 + self.ebits + self.mbits
        self.sign_bit = 1 << (self.bits - 1)
        self.magnitudes: list[Fraction] = []  # the finite values of the codes 0, 1, ... in order
        for code in range(self.sign_bit):
            value = self._exact(code)
            if value is None:
                break
            self.magnitudes.append(value)
        self.max = self.magnitudes[-1]
        self.max_code = len(self.magnitudes) - 1
        self.nan_code = {"fn": 0x7F, "ieee": 0x7F, None: None}[self.specials]

    def _exact(self, code: int) -> Fraction | None:
        """The exact magnitude of the code ``code`` (below the sign bit), or None for infinity and NaN."""
        exponent, mantissa = code >> self.mbits, code & ((1 << self.mbits) - 1)
        top = (1 << self.ebits) - 1
        if self.specials == "ieee" and exponent == top:
            return None
        if self.specials == "fn" and exponent == top and mantissa == (1 << self.mbits) - 1:
            return None
        if exponent == 0:
            return Fraction(mantissa, 1 << self.mbits) * Fraction(2) ** (1 - self.bias)
        return (1 + Fraction(mantissa, 1 << self.mbits)) * Fraction(2) ** (exponent - self.bias)

    def value(self, code: int) -> float:
        magnitude = code & (self.sign_bit - 1)
        negative = code & self.sign_bit
        if magnitude < len(self.magnitudes):
            value = float(self.magnitudes[magnitude])
        elif self.specials == "ieee" and magnitude == (((1 << self.ebits) - 1) << self.mbits):
            value = math.inf
        else:
            value = math.nan
        return -value if negative else value

    def encode(self, x: float | Fraction) -> int:
        """The code of ``x`` (a float, or an exact fraction), nearest with ties to even, saturating at ``±max``; a
        NaN gives the NaN code (sign kept), or ``±max`` where the format has none."""
        if isinstance(x, float) and math.isnan(x):
            negative = math.copysign(1.0, x) < 0
            magnitude = self.nan_code if self.nan_code is not None else self.max_code
            return magnitude | (self.sign_bit if negative else 0)
        negative = (math.copysign(1.0, x) < 0) if isinstance(x, float) else x < 0
        a = abs(x)
        if a >= self.max:  # infinities too
            magnitude = self.max_code
        else:
            a = Fraction(a)
            above = bisect.bisect_left(self.magnitudes, a)
            if self.magnitudes[above] == a:
                magnitude = above
            else:
                low, high = self.magnitudes[above - 1], self.magnitudes[above]
                if a - low < high - a:
                    magnitude = above - 1
                elif high - a < a - low:
                    magnitude = above
                else:
                    magnitude = above if above % 2 == 0 else above - 1
        return magnitude | (self.sign_bit if negative else 0)

    def neighbours(self, x: float) -> tuple[float, float]:
        """The two representable values around the finite ``x`` (equal when ``x`` is one), saturated."""
        a = min(Fraction(abs(x)), self.max)
        above = bisect.bisect_left(self.magnitudes, a)
        low = self.magnitudes[above] if self.magnitudes[above] == a else self.magnitudes[above - 1]
        pair = (float(low), float(self.magnitudes[above]))
        return (-pair[1], -pair[0]) if x < 0 else pair

    def midpoints(self) -> list[float]:
        """Every tie between two neighbouring magnitudes (as fp32: all are exact) and the fp32 numbers on either
        side of it, and the same just above the largest value."""
        found = []
        for low, high in zip(self.magnitudes, self.magnitudes[1:]):
            middle = float((low + high) / 2)
            found += [middle, fp32_step(middle, -1), fp32_step(middle, 1)]
        top = float(self.max)
        found += [top, fp32_step(top, 1), fp32_step(top, -1)]
        return sorted(set(found))


REFERENCES = {name: Reference(name) for name in SPEC}
