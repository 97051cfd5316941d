"""Block-scaled formats over a flat fp32 tensor whose length is a multiple of the block: each block of entries
shares a scale, and each entry is a ``gcomp.compressors.minifloat`` element of the block divided by its scale.

- ``fp8_e4m3`` / ``fp8_e5m2`` (blocks of ``block`` entries, 128 by default): one fp32 scale per block,
  ``amax / max`` (``max`` the element format's largest value: 448, 57344); the elements are ``x / scale`` in
  E4M3 / E5M2. A block of zeros has scale 0 and zero codes (it decodes to zeros; so does a block whose ``amax /
  max`` underflows fp32); a block holding a NaN or an infinity has a NaN scale and decodes to NaN.
- ``mxfp8_e4m3``, ``mxfp8_e5m2``, ``mxfp6_e3m2``, ``mxfp6_e2m3``, ``mxfp4`` (OCP Microscaling v1.0): blocks of 32,
  one E8M0 scale each (a byte ``s``, the value ``2^(s - 127)``, ``0xFF`` NaN), the shared exponent
  ``floor(log2(amax)) - emax_elem`` clamped to ``[-127, 127]`` (a block of zeros gets ``2^-127``); the elements are
  ``x / 2^shared`` quantised with saturation. A block holding a NaN or an infinity gets the NaN scale and decodes
  to NaN throughout (the spec's NaN scale; an infinity's ``log2`` overflows the scale's range, as in the spec's
  reference code).
- ``nvfp4`` (NVIDIA): blocks of 16 E2M1 elements, one E4M3 scale per block and one fp32 scale for the tensor:
  ``global = amax_tensor / (6 * 448)`` over its finite entries, the block scale ``(amax_block / 6) / global``
  rounded to E4M3, the elements ``x / (scale_e4m3 * global)``. A block holding a NaN or an infinity gets the E4M3
  NaN scale and decodes to NaN; a tensor of zeros has ``global = 0`` and decodes to zeros.

The elements round to nearest even, or stochastically (``rounding="stochastic"``, ``minifloat.encode``'s rule);
scales are always chosen as above. FP6 and FP4 codes are packed (``block_wire``: FP4 2 to a byte, FP6 a plane of
low nibbles then a plane of top bits). The decode gathers two entries per index from a table of pairs (two FP8
codes, a packed FP4 byte, an FP6 pair's nibbles and top bits), then multiplies each block by its scale.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass

import torch

from gcomp.compressors import minifloat
from gcomp.compressors.block_wire import check_length, pack, pair_index, pair_table
from gcomp.compressors.minifloat import Minifloat

E4M3 = minifloat.FORMATS["e4m3"]
DECODE_SLABS = 4  # the decode's slab, in the encode's (``minifloat.SLAB``): fewer slabs, less Python per entry


@dataclass(frozen=True)
class BlockFormat:
    """A block-scaled format: ``encode`` gives its wire tensors (all 1-d: the element codes as uint8, packed for
    FP6 and FP4; then the scales: fp32 for ``fp8_*``, uint8 E8M0 for MX, uint8 E4M3 and one fp32 for ``nvfp4``);
    ``decode`` the fp32 entries back. ``kind``: ``fp8``, ``mx`` or ``nvfp4``. A format needs no collective: the
    method that uses it sends these tensors (its own all-to-all and all-gather)."""

    name: str
    element: Minifloat
    block: int
    kind: str

    @property
    def element_bits(self) -> int:
        return self.element.bits

    @property
    def bits_per_entry(self) -> float:
        """Bits on the wire per entry, as the tensor grows (the scales' share included)."""
        return self.element_bits + {"fp8": 32, "mx": 8, "nvfp4": 8}[self.kind] / self.block

    def wire_bytes(self, n: int) -> int:
        """The bytes ``encode`` of ``n`` entries gives, exactly."""
        check_length(n, self.block, self.name)
        codes = n * self.element_bits // 8
        blocks = n // self.block
        return codes + {"fp8": 4 * blocks, "mx": blocks, "nvfp4": blocks + 4}[self.kind]

    # -- scales ------------------------------------------------------------------------------------------------
    def _amax(self, flat: torch.Tensor, work: minifloat.Work) -> torch.Tensor:
        # the maxima of the magnitudes' bits: ordered as the magnitudes, a NaN above infinity (an integer reduction
        # is several times faster than a float one on the CPU, most of all on rows of 16)
        amax = torch.empty(flat.numel() // self.block, dtype=torch.int32, device=flat.device)
        for start, stop in minifloat._slabs(flat.numel(), flat.device, self.block):
            a = torch.abs(flat[start:stop], out=work.f[:stop - start]).view(torch.int32)
            torch.amax(a.view(-1, self.block), 1, out=amax[start // self.block:stop // self.block])
        return amax.view(torch.float32)

    def _scales(self, amax: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor, bool]:
        """The scale tensors sent, the per-block number the elements are multiplied (or divided) by, and whether
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
        glob = torch.nan_to_num(amax, nan=0.0, posinf=0.0).reshape(-1).amax(0, keepdim=True) if amax.numel() \
            else amax.new_zeros(1)
        glob = glob / (6 * E4M3.max)
        ratio = amax.div(6).div_(glob).nan_to_num_(nan=0.0).masked_fill_(~finite, float("nan"))  # global 0: 0
        code = ratio.clamp_(max=E4M3.max).to(torch.float8_e4m3fn)  # to nearest even; NaN: S.1111.111
        divisor = e4m3_value(code.view(torch.uint8)).mul_(glob)
        return [code.view(torch.uint8), glob], divisor.masked_fill_(divisor == 0, 1.0), True

    def decode_scales(self, scales: list[torch.Tensor]) -> torch.Tensor:
        """Each block's fp32 scale (NaN for a NaN scale) from the scale tensors ``encode`` sent."""
        if self.kind == "fp8":
            return scales[0]
        if self.kind == "mx":
            return e8m0_value(scales[0])
        return e4m3_value(scales[0]).mul_(scales[1])

    # -- the wire ----------------------------------------------------------------------------------------------
    def encode(self, x: torch.Tensor, rounding: str = "nearest", generator: torch.Generator | None = None,
               codes: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The wire tensors of the flat fp32 ``x`` (its length a multiple of ``block``): the element codes, then the
        scales. ``rounding``: ``"nearest"`` (ties to even) or ``"stochastic"`` (unbiased; draws from
        ``generator`` on ``x``'s device). ``codes``: a flat uint8 tensor the element codes are written into (a
        buffer kept across steps: a fresh one costs its page faults on the CPU), else a fresh one."""
        if rounding not in ("nearest", "stochastic"):
            raise ValueError(f"rounding must be 'nearest' or 'stochastic', not {rounding!r}")
        if x.dtype != torch.float32 or x.dim() != 1:
            raise ValueError(f"{self.name} encodes a flat fp32 tensor, not {x.dtype} of shape {tuple(x.shape)}")
        n = x.numel()
        check_length(n, self.block, self.name)
        flat = x.contiguous()
        if n == 0:
            return [x.new_empty(0, dtype=torch.uint8), *self._scales(x.new_empty(0))[0]]
        work = minifloat.work_for(n, x.device)
        scales, factor, divide = self._scales(self._amax(flat, work))
        cast = rounding == "nearest" and self.element.carrier is not None
        if cast and not divide:
            factor = factor * minifloat.alignment(self.element)  # powers of two: exact
        if codes is None:
            codes = torch.empty(n * self.element_bits // 8, dtype=torch.uint8, device=x.device)
        elif codes.dtype != torch.uint8 or codes.shape != (n * self.element_bits // 8,):
            raise ValueError(f"{self.name}: codes must be uint8 of shape ({n * self.element_bits // 8},), not "
                             f"{codes.dtype} {tuple(codes.shape)}")
        scaled = torch.empty_like(work.f)
        element = torch.empty(scaled.numel(), dtype=torch.uint8, device=x.device) if self.element_bits < 8 else None
        spare = work.s.view(torch.uint8)
        for start, stop in minifloat._slabs(n, x.device, self.block):
            m, blocks = stop - start, slice(start // self.block, stop // self.block)
            rows = flat[start:stop].view(-1, self.block)
            op = torch.div if divide else torch.mul
            values = op(rows, factor[blocks, None], out=scaled[:m].view(-1, self.block)).view(-1)
            target = codes[start:stop] if element is None else element[:m]
            if cast:
                minifloat.cast_codes(values, self.element, target, spare[:m])
            else:
                minifloat.encode_slab(values, self.element, target, work, rounding, generator, False)
            if element is not None:
                bits = self.element_bits
                pack(element[:m], bits, codes, n, start)
        return [codes, *scales]

    def decode(self, tensors: list[torch.Tensor], n: int, out: torch.Tensor | None = None,
               minuend: torch.Tensor | None = None) -> torch.Tensor:
        """The ``n`` fp32 entries of the wire ``tensors`` (written into ``out`` if given, and returned).

        ``minuend`` (fp32, at most ``n`` entries): ``out`` gets ``minuend - decode`` over ``minuend``'s entries
        instead, non-finite differences set to 0 (error feedback's residual), slab by slab in cache: the decoded
        entries are never written out whole."""
        check_length(n, self.block, self.name)
        codes = tensors[0]
        if codes.numel() != n * self.element_bits // 8:
            raise ValueError(f"{self.name}: {codes.numel()} code bytes cannot hold {n} entries")
        length = n if minuend is None else minuend.numel()
        if length > n:
            raise ValueError(f"{self.name}: a minuend of {length} entries for {n} decoded")
        if out is None:
            out = torch.empty(length, dtype=torch.float32, device=codes.device)
        scale = self.decode_scales(list(tensors[1:]))
        table = pair_table(self.element, codes.device)
        slab = DECODE_SLABS * minifloat.SLAB  # its buffers: 2 bytes an entry (4 more with a minuend)
        slab = max(self.block, slab // self.block * self.block)
        index = torch.empty(min(n, slab) // 2 if minifloat.in_slabs(codes.device) else n // 2, dtype=torch.int32,
                            device=codes.device)
        decoded = None if minuend is None else torch.empty(index.numel() * 2, dtype=torch.float32,
                                                           device=codes.device)
        bits = self.element_bits
        for start, stop in minifloat._slabs(n, codes.device, self.block, slab):
            if start >= length:
                break
            chosen = pair_index(codes, bits, n, start, stop, index[:(stop - start) // 2])
            into = out[start:stop] if decoded is None else decoded[:stop - start]
            torch.index_select(table, 0, chosen, out=into.view(torch.int64))
            into.view(-1, self.block).mul_(scale[start // self.block:stop // self.block, None])
            if decoded is not None:
                end = min(stop, length)
                torch.sub(minuend[start:end], into[:end - start], out=out[start:end])
                out[start:end].nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        return out


def e4m3_value(code: torch.Tensor) -> torch.Tensor:
    """The fp32 values of the uint8 E4M3 ``code``s, gathered from ``minifloat.table`` (on the CPU several times
    faster than torch's float8 -> fp32 cast, the same values)."""
    return torch.index_select(minifloat.table(E4M3, code.device), 0, code.to(torch.int32))


def e8m0_value(code: torch.Tensor) -> torch.Tensor:
    """``2^(code - 127)`` for the uint8 E8M0 ``code`` (``2^-127`` is fp32's subnormal ``2^22`` bits), NaN for 255,
    built from its bits."""
    bits = code.to(torch.int32).bitwise_left_shift_(23)
    bits.masked_fill_(code == 0, 1 << 22).masked_fill_(code == 255, 0x7FC00000)
    return bits.view(torch.float32)


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
