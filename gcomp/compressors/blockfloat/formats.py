"""Block-scaled formats over rows of fp32 entries, each row (a chunk) encoded on its own and its length a multiple
of the block: each block of entries shares a scale, and each entry is a ``minifloat`` element of the block divided
by its scale.

- ``fp8_e4m3`` / ``fp8_e5m2`` (blocks of ``block`` entries, 128 by default): one fp32 scale per block,
  ``amax / max`` (``max`` the element format's largest value: 448, 57344); the elements are ``x / scale`` in
  E4M3 / E5M2. A block of zeros has scale 0 and zero codes (it decodes to zeros; so does a block whose ``amax /
  max`` underflows fp32); a block holding a NaN or an infinity has a NaN scale and decodes to NaN.
- ``mxfp8_e4m3``, ``mxfp8_e5m2``, ``mxfp6_e3m2``, ``mxfp6_e2m3``, ``mxfp4`` (OCP Microscaling v1.0): blocks of 32,
  one E8M0 scale each (a byte ``s``, the value ``2^(s - 127)``, ``0xFF`` NaN), the shared exponent
  ``floor(log2(amax)) - emax_elem`` clamped to ``[-127, 127]`` (a block of zeros gets ``2^-127``); the elements are
  ``x / 2^shared`` quantised with saturation. A block holding a NaN or an infinity gets the NaN scale and decodes
  to NaN throughout (an infinity's ``log2`` overflows the scale's range, as in the spec's reference code).
- ``nvfp4`` (NVIDIA): blocks of 16 E2M1 elements, one E4M3 scale per block and one fp32 scale per row:
  ``global = amax_row / (6 * 448)`` over its finite entries, the block scale ``(amax_block / 6) / global``
  rounded to E4M3, the elements ``x / (scale_e4m3 * global)``. A block holding a NaN or an infinity gets the E4M3
  NaN scale and decodes to NaN; a row of zeros has ``global = 0`` and decodes to zeros.

The elements round to nearest even, or stochastically (``minifloat.encode``'s rule); scales are always chosen as
above. The codes of a row: 8-bit a byte each; FP4 two to a byte, the first in the low nibble (``c0 | c1 << 4``);
FP6 in two planes, first ``n / 2`` bytes of low nibbles (as FP4), then ``n / 4`` bytes of the top 2 bits
(``hi(c0) | hi(c1) << 2 | hi(c2) << 4 | hi(c3) << 6``, where ``c = lo | hi << 4``). They are packed as whole words
(int16, int32) of a little-endian host.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass

import torch

from gcomp.compressors.blockfloat import minifloat
from gcomp.compressors.blockfloat.minifloat import ROUNDINGS, Minifloat

E4M3 = minifloat.FORMATS["e4m3"]


def check_length(n: int, block: int, name: str) -> None:
    if not isinstance(n, int) or n < 0 or n % block:
        raise ValueError(f"{name} takes a multiple of its block of {block} entries, not {n!r}")


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The uint8 ``codes`` ``(R, n)`` (each below ``2^bits``, n a multiple of 4) in the layout above: ``(R, n bits
    / 8)``."""
    if bits == 8 or not codes.numel():
        return codes
    pairs = codes.view(torch.int16).bitwise_and(0x0F0F)  # lo(c0) | lo(c1) << 8
    low = pairs.bitwise_or_(pairs.bitwise_right_shift(4)).to(torch.uint8)  # the low byte
    if bits == 4:
        return low
    words = codes.view(torch.int32).bitwise_right_shift(4).bitwise_and_(0x03030303)  # hi(c_k) at bit 8k
    words.bitwise_or_(words.bitwise_right_shift(6))  # hi(c1) at bit 2, hi(c3) at 18
    return torch.cat([low, words.bitwise_or_(words.bitwise_right_shift(12)).to(torch.uint8)], 1)  # all four


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The ``(R, n)`` codes ``pack`` put in ``packed``, one per byte."""
    if bits == 8:
        return packed
    rows, device = packed.shape[0], packed.device
    nibbles = torch.arange(0, 8, 4, dtype=torch.uint8, device=device)
    codes = packed[:, :n // 2, None].bitwise_right_shift(nibbles).bitwise_and_(15).view(rows, n)
    if bits == 6:
        tops = packed[:, n // 2:, None].bitwise_right_shift(torch.arange(0, 8, 2, dtype=torch.uint8, device=device))
        codes.bitwise_or_(tops.bitwise_and_(3).view(rows, n).bitwise_left_shift_(4))
    return codes


def e8m0_value(code: torch.Tensor) -> torch.Tensor:
    """``2^(code - 127)`` for the uint8 E8M0 ``code`` (``2^-127`` is fp32's subnormal ``2^22`` bits), NaN for 255."""
    bits = code.to(torch.int32).bitwise_left_shift_(23)
    return bits.masked_fill_(code == 0, 1 << 22).masked_fill_(code == 255, 0x7FC00000).view(torch.float32)


@dataclass(frozen=True)
class BlockFormat:
    """A block-scaled format: ``encode`` gives the wire tensors of each row, ``(R, ...)``: the element codes as
    uint8, packed for FP6 and FP4, then the scales (fp32 for ``fp8_*``, uint8 E8M0 for MX, uint8 E4M3 and one
    fp32 for ``nvfp4``); ``decode`` the fp32 rows back. ``kind``: ``fp8``, ``mx`` or ``nvfp4``."""

    name: str
    element: Minifloat
    block: int
    kind: str

    @property
    def element_bits(self) -> int:
        return self.element.bits

    @property
    def bits_per_entry(self) -> float:
        """Bits on the wire per entry, as the row grows (the scales' share included)."""
        return self.element_bits + {"fp8": 32, "mx": 8, "nvfp4": 8}[self.kind] / self.block

    def wire_bytes(self, n: int) -> int:
        """The bytes ``encode`` gives for a row of ``n`` entries, exactly."""
        check_length(n, self.block, self.name)
        blocks = n // self.block
        return n * self.element_bits // 8 + {"fp8": 4 * blocks, "mx": blocks, "nvfp4": blocks + 4}[self.kind]

    def _scales(self, amax: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor, bool]:
        """The scale tensors sent, the per-block number the elements are divided (or multiplied) by, and whether
        it divides."""
        if self.kind == "fp8":
            scale = (amax / self.element.max).masked_fill_(~torch.isfinite(amax), float("nan"))
            return [scale], torch.where(scale == 0, torch.ones_like(scale), scale), True
        if self.kind == "mx":  # in place on amax's bits: its biased exponent, the scale code, 1 / scale
            code = amax.view(torch.int32).bitwise_right_shift_(23).bitwise_and_(0xFF)
            nan = code == 255
            code.sub_(self.element.emax).clamp_(0, 254).masked_fill_(nan, 255)
            wire = code.to(torch.uint8)
            factor = code.neg_().add_(254).bitwise_left_shift_(23)  # 2^(127 - s) = 1 / 2^shared: the code 254 - s
            factor.masked_fill_(wire == 254, 1 << 22).masked_fill_(nan, 0)  # 2^-127 is fp32's subnormal; NaN: none
            return [wire], factor.view(torch.float32), False
        finite = torch.isfinite(amax)
        glob = torch.nan_to_num(amax, nan=0.0, posinf=0.0).amax(1, keepdim=True) if amax.shape[1] \
            else amax.new_zeros(amax.shape[0], 1)
        glob = glob / (6 * E4M3.max)
        ratio = amax.div(6).div_(glob).nan_to_num_(nan=0.0).masked_fill_(~finite, float("nan"))  # global 0: 0
        code = ratio.clamp_(max=E4M3.max).to(torch.float8_e4m3fn).view(torch.uint8)  # nearest even; NaN: S.1111.111
        divisor = minifloat.decode(code, E4M3).mul_(glob)
        return [code, glob], divisor.masked_fill_(divisor == 0, 1.0), True

    def decode_scales(self, scales: list[torch.Tensor]) -> torch.Tensor:
        """Each block's fp32 scale, ``(R, blocks)`` (NaN for a NaN scale), from the scale tensors sent."""
        if self.kind == "fp8":
            return scales[0]
        if self.kind == "mx":
            return e8m0_value(scales[0])
        return minifloat.decode(scales[0], E4M3).mul_(scales[1])

    def encode(self, x: torch.Tensor, rounding: str = "nearest", generator: torch.Generator | None = None,
               decoded: bool = False) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """The wire tensors of the rows of ``x`` (fp32 ``(R, n)``, n a multiple of ``block``), and with ``decoded``
        what ``decode`` gives back of them (else None). ``rounding``: ``"nearest"`` (ties to even) or
        ``"stochastic"`` (unbiased; draws from ``generator`` on ``x``'s device)."""
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be 'nearest' or 'stochastic', not {rounding!r}")
        if x.dtype != torch.float32 or x.dim() != 2:
            raise ValueError(f"{self.name} encodes fp32 rows, not {x.dtype} of shape {tuple(x.shape)}")
        rows, n = x.shape
        check_length(n, self.block, self.name)
        blocks = x.reshape(rows, -1, self.block)
        # the maxima of the magnitudes' bits: ordered as the magnitudes, a NaN above infinity
        scales, factor, divide = self._scales(blocks.abs().view(torch.int32).amax(2).view(torch.float32))
        cast = rounding == "nearest" and self.element.carrier is not None
        if cast and not divide:
            factor = factor * minifloat.alignment(self.element)  # powers of two: exact
        values = blocks / factor[..., None] if divide else blocks * factor[..., None]
        if cast:  # fp8's elements need no alignment
            codes = minifloat.cast_codes(values, self.element)
        else:  # the codes of a block whose scale says NaN are any byte
            codes = minifloat.encode(values, self.element, rounding, generator)
        codes = codes.view(rows, n)
        wire = [pack(codes, self.element_bits), *scales]
        if not decoded:
            return wire, None
        return wire, self._values(codes, scales)

    def decode(self, tensors: list[torch.Tensor], n: int) -> torch.Tensor:
        """The fp32 ``(R, n)`` rows of the wire ``tensors``."""
        check_length(n, self.block, self.name)
        if tensors[0].shape[-1] != n * self.element_bits // 8:
            raise ValueError(f"{self.name}: {tensors[0].shape[-1]} code bytes a row cannot hold {n} entries")
        return self._values(unpack(tensors[0], self.element_bits, n), tensors[1:])

    def _values(self, codes: torch.Tensor, scales) -> torch.Tensor:
        values = minifloat.decode(codes, self.element).view(codes.shape[0], -1, self.block)
        return values.mul_(self.decode_scales(list(scales))[..., None]).view(codes.shape)


_MX = {"mxfp8_e4m3": "e4m3", "mxfp8_e5m2": "e5m2", "mxfp6_e3m2": "e3m2", "mxfp6_e2m3": "e2m3", "mxfp4": "e2m1"}
NAMES = ("fp8_e4m3", "fp8_e5m2", *_MX, "nvfp4")


def block_format(name: str, block: int | None = None) -> BlockFormat:
    """The block format called ``name`` (one of ``NAMES``); ``block`` sets the block of the ``fp8_*`` formats
    (128 by default; a positive multiple of 4); MX's is 32 and NVFP4's 16, fixed by their specs."""
    if name.startswith("fp8_") and name[4:] in ("e4m3", "e5m2"):
        block = 128 if block is None else block
        if not isinstance(block, int) or block < 4 or block % 4:
            raise ValueError(f"{name}: block must be a positive multiple of 4, not {block!r}")
        return BlockFormat(name, minifloat.FORMATS[name[4:]], block, "fp8")
    fixed = 32 if name in _MX else 16 if name == "nvfp4" else None
    if fixed is None:
        close = difflib.get_close_matches(name, NAMES, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"unknown block format {name!r}{hint} (known: {', '.join(NAMES)})")
    if block is not None and block != fixed:
        raise ValueError(f"{name} has blocks of {fixed} entries by its spec, not {block}")
    return BlockFormat(name, minifloat.FORMATS[_MX.get(name, "e2m1")], fixed, "mx" if name in _MX else "nvfp4")
