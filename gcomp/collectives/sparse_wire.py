"""The sparse wire of the sparse and spardl families: values at positions, as all-gather payloads (one set per rank)
or point-to-point message sections (``count`` sets per message).

- Values: ``fp32`` (the bucket's own dtype, as it is), ``bf16``, ``fp16`` or ``fp8_e4m3`` with one fp32 scale per
  payload or message (its largest finite magnitude / 448, E4M3's largest). Narrow values travel as bytes, a row per
  value (gloo gathers no int16 nor float8); ``narrow`` also gives them as decoded, so rounding stays in the residual.
  fp16 overflows past 65504 to an infinity, non-finite on every rank as a NaN gradient would be.
- Positions: ``raw``, int32 (int64 past 2**31 entries) in the order given; or ``coded``, sorted (the values permuted
  alike) and sent as the smaller of a bitmap (bit p set for each position p: n bits) and Elias-Fano (with
  ``L = max(0, floor(log2(n / k)))``, each position's low L bits packed, then its high part in unary: k L + k +
  ceil(n / 2**L) bits), whole bytes, bits least significant first. The form depends on ``(n, k)`` alone. Elias-Fano
  keeps repeated positions; the bitmap cannot, so ``sort_pairs`` folds a repeat into one slot (values summed) and
  frees the rest as position 0 with value 0. A message's ``count`` sets share one code, set s offset by ``s * n``.

Whole-tensor operations, no host synchronisation: ``n`` and ``k`` come from shapes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import torch

from gcomp.bucket import index_dtype
from gcomp.collectives import bitpack
from gcomp.core import LARGEST, Fidelity
from gcomp.params import OneOf

VALUES = ("fp32", "bf16", "fp16", "fp8_e4m3")
POSITIONS = ("coded", "raw")
_NARROW = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8_e4m3": torch.float8_e4m3fn}
_ROUNDING = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11, "fp8_e4m3": 2.0 ** -4}  # relative, of a value (fp8: near the top)
FP8_MAX = 448.0
BITMAP, ELIAS_FANO = "bitmap", "elias_fano"

PositionsParam = Annotated[str, OneOf(*POSITIONS), "positions sorted and coded (Elias-Fano or bitmap, the smaller; "
                           "lossless), or raw int32 (int64 past 2**31 entries)"]
ValuesParam = Annotated[str, OneOf(*VALUES), "values on the wire: fp32 (the bucket's dtype), bf16, fp16, fp8_e4m3 "
                        "(one fp32 scale per payload); rounding stays in the residual"]


# --- values ---------------------------------------------------------------------------------------------------------

def narrow(values: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(wire, scale, rounded)``: the values as they travel (``values`` itself for ``fp32``, else a uint8 view,
    ``(*values.shape, bytes)``), fp8's scale (one fp32 entry, else None) and the values as decoded."""
    if name == "fp32":
        return values, None, values
    scale = None
    if name == "fp8_e4m3":
        finite = torch.nan_to_num(values.float().abs(), nan=0.0, posinf=0.0, neginf=0.0)
        amax = finite.amax().reshape(1) if values.numel() else finite.new_zeros(1)
        scale = torch.where(amax > 0, amax / FP8_MAX, 1.0)
        small = (values.float() / scale).to(_NARROW[name])
        rounded = (small.float() * scale).to(values.dtype)
    else:
        small = values.to(_NARROW[name])
        rounded = small.to(values.dtype)
    return small.unsqueeze(-1).view(torch.uint8), scale, rounded


def widen(wire: torch.Tensor, name: str, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The values of ``narrow``'s ``wire`` (or a stack of them, ``scale`` shaped ``(..., 1)``) in ``dtype``."""
    if name == "fp32":
        return wire.to(dtype)
    values = wire.view(_NARROW[name]).squeeze(-1)
    return (values.float() * scale).to(dtype) if name == "fp8_e4m3" else values.to(dtype)


# --- coded positions --------------------------------------------------------------------------------------------

def low_bits(n: int, k: int) -> int:
    """Elias-Fano's ``L = max(0, floor(log2(n / k)))``, in integers (exact at any size)."""
    return max(0, (n // k).bit_length() - 1) if k else 0


def _ef_bits(n: int, k: int) -> int:
    return k * low_bits(n, k) + k + -(-n // (1 << low_bits(n, k))) if k else 0


def form(n: int, k: int) -> str:
    """The form of the code of ``k`` positions into ``n`` entries: the bitmap where it is strictly smaller."""
    if n < 0 or k < 0:
        raise ValueError(f"coded positions need n >= 0 and k >= 0; got n={n}, k={k}")
    return BITMAP if k and -(-n // 8) < -(-_ef_bits(n, k) // 8) else ELIAS_FANO


def coded_bytes(n: int, k: int) -> int:
    """Bytes of the code of ``k`` positions into ``n``: ``ceil(n / 8)`` (bitmap) or ``ceil(ef_bits / 8)``."""
    return -(-n // 8) if form(n, k) == BITMAP else -(-_ef_bits(n, k) // 8)


def bits_per_position(n: int, k: int) -> float:
    return 8 * coded_bytes(n, k) / k if k else 0.0


def sort_pairs(positions: torch.Tensor, values: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``positions`` (int64) sorted and ``values`` permuted alike; where the bitmap is chosen, repeats folded into
    their first slot (values summed in order) and the freed slots at the end as position 0, value 0."""
    ordered, order = torch.sort(positions.long(), stable=True)
    values = values[order]
    k = ordered.numel()
    if form(n, k) != BITMAP or k < 2:
        return ordered, values
    first = torch.ones(k, dtype=torch.bool, device=ordered.device)
    torch.ne(ordered[1:], ordered[:-1], out=first[1:])
    run = torch.cumsum(first, 0).sub_(1)
    return torch.zeros_like(ordered).scatter_(0, run, ordered), torch.zeros_like(values).index_add_(0, run, values)


def encode_positions(positions: torch.Tensor, n: int) -> torch.Tensor:
    """The code (``coded_bytes(n, k)`` uint8) of the non-decreasing ``positions`` in ``[0, n)`` (the bitmap sets a
    repeat, or a freed slot's trailing 0, once)."""
    k, device = positions.numel(), positions.device
    nbytes, p = coded_bytes(n, k), positions.long()
    if form(n, k) == BITMAP:
        real = torch.ones(k, dtype=torch.bool, device=device)
        torch.gt(p[1:], p[:-1], out=real[1:])
        bits = torch.zeros(nbytes * 8 + 1, dtype=torch.uint8, device=device)
        bits.index_fill_(0, torch.where(real, p, nbytes * 8), 1)
        return bitpack.pack_flags_(bits[:-1]).view(torch.uint8)[:nbytes]
    if not k:
        return torch.zeros(0, dtype=torch.uint8, device=device)
    low = low_bits(n, k)
    bits = torch.zeros(k * low + k + -(-n // (1 << low)), dtype=torch.uint8, device=device)
    if low:
        shifts = torch.arange(low, dtype=torch.int64, device=device)
        bits[:k * low] = p.unsqueeze(1).bitwise_right_shift(shifts).bitwise_and_(1).view(-1).to(torch.uint8)
    bits.index_fill_(0, p.bitwise_right_shift(low).add_(torch.arange(k, device=device)).add_(k * low), 1)
    return bitpack.pack_flags_(bits).view(torch.uint8)[:nbytes]


def _bits(code: torch.Tensor, nbits: int) -> torch.Tensor:
    """The first ``nbits`` bits of ``(..., bytes)`` uint8 codes, as ``(..., nbits)`` 0/1 uint8."""
    shifts = torch.arange(8, dtype=torch.uint8, device=code.device)
    return code.unsqueeze(-1).bitwise_right_shift(shifts).bitwise_and_(1).reshape(*code.shape[:-1], -1)[..., :nbits]


def _set_bits(bits: torch.Tensor, k: int) -> torch.Tensor:
    """``(..., k)`` int64 indices of the first ``k`` set bits of ``(..., m)`` 0/1 ``bits`` (0 past the last), by a
    cumulative sum and a scatter: no ``nonzero``."""
    m = bits.shape[-1]
    rank = torch.cumsum(bits, -1, dtype=torch.int32 if m < 2**31 else torch.int64)
    slot = torch.where(bits.bool(), rank - 1, k).clamp_(max=k).long()  # unset bits and any past k: a spare slot
    out = torch.zeros(*bits.shape[:-1], k + 1, dtype=torch.int64, device=bits.device)
    return out.scatter_(-1, slot, torch.arange(m, device=bits.device).expand_as(slot))[..., :k]


def decode_positions(code: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The ``(..., k)`` int64 positions of ``(..., coded_bytes(n, k))`` codes: sorted, repeats kept (Elias-Fano);
    the set bits ascending, then 0 (bitmap)."""
    if code.shape[-1] != coded_bytes(n, k):
        raise ValueError(f"a code of {k} positions into {n} entries has {coded_bytes(n, k)} bytes; got "
                         f"{code.shape[-1]}")
    if form(n, k) == BITMAP:
        return _set_bits(_bits(code, n), k)
    if not k:
        return torch.zeros(*code.shape[:-1], 0, dtype=torch.int64, device=code.device)
    low = low_bits(n, k)
    bits = _bits(code, k * low + k + -(-n // (1 << low)))
    high = _set_bits(bits[..., k * low:], k).sub_(torch.arange(k, device=code.device)).bitwise_left_shift_(low)
    if low:
        shifts = torch.arange(low, dtype=torch.int64, device=code.device)
        high.add_(bits[..., :k * low].reshape(*code.shape[:-1], k, low).long().bitwise_left_shift_(shifts).sum(-1))
    return high


# --- the wire -------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SparseWire:
    """How values and positions travel: ``positions`` (``POSITIONS``) and ``values`` (``VALUES``). Tensors, in
    order: the values, the positions (one code, or raw), fp8's scale."""

    positions: str = "raw"
    values: str = "fp32"

    def __post_init__(self):
        if self.positions not in POSITIONS:
            raise ValueError(f"positions must be one of {', '.join(POSITIONS)}; got {self.positions!r}")
        if self.values not in VALUES:
            raise ValueError(f"values must be one of {', '.join(VALUES)}; got {self.values!r}")

    @property
    def fidelity(self) -> Fidelity:
        """Sent entries exactly (``fp32``), or within the narrow dtype's rounding: the ``largest`` kind."""
        return LARGEST if self.values == "fp32" else Fidelity("largest", _ROUNDING[self.values])

    def sections(self, n: int, k: int, dtype: torch.dtype, count: int = 1) -> list[tuple[torch.dtype, int]]:
        """The ``(dtype, numel)`` of each tensor of ``count`` sets of ``k`` entries into ``n``."""
        m = count * k
        values = (dtype, m) if self.values == "fp32" else (torch.uint8, m * _NARROW[self.values].itemsize)
        where = (torch.uint8, coded_bytes(count * n, m)) if self.positions == "coded" else (index_dtype(n), m)
        return [values, where] + [(torch.float32, 1)] * (self.values == "fp8_e4m3")

    def nbytes(self, n: int, k: int, dtype: torch.dtype = torch.float32, count: int = 1) -> int:
        return sum(dt.itemsize * m for dt, m in self.sections(n, k, dtype, count))

    def encode(self, index: torch.Tensor, values: torch.Tensor, n: int):
        """``(tensors, index, values, sent)`` of ``count`` sets (``index``, ``values``: ``(count, k)``): the tensors
        (flat, in ``sections``' order), then the positions, the values and the values as decoded, ``(count, k)``
        each in the order sent (``values - sent`` is what rounding took off)."""
        count, k = index.shape
        if self.positions == "coded":
            offsets = torch.arange(count, device=index.device)[:, None] * n
            flat, values = sort_pairs((index.long() + offsets).reshape(-1), values.reshape(-1), count * n)
            where = encode_positions(flat, count * n)
            index, values = flat.view(count, k) - offsets, values.view(count, k)
        else:
            where = index.reshape(-1).to(index_dtype(n))
        wire, scale, sent = narrow(values.reshape(-1), self.values)
        return [wire, where] + ([] if scale is None else [scale]), index, values, sent.view(count, k)

    def decode(self, tensors, n: int, k: int, dtype: torch.dtype, count: int = 1
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(positions, values)``, ``(..., count, k)`` each, of ``encode``'s tensors or a stack of them (leading
        dimensions: every rank's, gathered)."""
        wire, where = tensors[0], tensors[1]
        lead = where.shape[:-1]
        if self.positions == "coded":
            offsets = torch.arange(count, device=where.device)[:, None] * n
            index = decode_positions(where, count * n, count * k).view(*lead, count, k) - offsets
        else:
            index = where.long().view(*lead, count, k)
        wire = wire.reshape(*lead, count * k, *(() if self.values == "fp32" else (_NARROW[self.values].itemsize,)))
        scale = tensors[2] if len(tensors) > 2 else None
        return index, widen(wire, self.values, scale, dtype).view(*lead, count, k)
