"""Sparse values on the wire in a narrower dtype: ``fp32`` (the bucket's own dtype, as it is), ``bf16``, ``fp16``,
or ``fp8_e4m3`` with one fp32 scale per payload (its largest finite magnitude / 448, E4M3's largest value).

The narrow values travel as bytes, one row per value (gloo all-gathers no int16 nor float8 tensors);
``narrow`` also gives back the values as they will be decoded, so a method keeps what rounding took off in its
residual and nothing is lost. Whole-tensor operations, no host synchronisation. fp16 overflows past 65504: such a
value arrives as an infinity, non-finite on every rank as a NaN gradient would be (bf16 and fp8 with its scale
cover fp32's range).
"""
from __future__ import annotations

import torch

VALUE_DTYPES = ("fp32", "bf16", "fp16", "fp8_e4m3")
_WIRE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8_e4m3": torch.float8_e4m3fn}
FP8_MAX = 448.0


def check(name: str) -> str:
    if name not in VALUE_DTYPES:
        raise ValueError(f"values must be one of {', '.join(VALUE_DTYPES)}; got {name!r}")
    return name


def value_bits(name: str, dtype: torch.dtype) -> int:
    """Bits per value on the wire (``fp32`` keeps the bucket's ``dtype``); fp8's scale is per payload, apart."""
    return 8 * (dtype.itemsize if name == "fp32" else _WIRE[name].itemsize)


def scale_bytes(name: str) -> int:
    """Bytes sent per payload beside the values: fp8's fp32 scale."""
    return 4 if name == "fp8_e4m3" else 0


def narrow(values: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(wire, scale, rounded)``: the values as they travel (a uint8 view, ``(*values.shape, bytes)``, of the
    narrow dtype, or ``values`` itself for ``fp32``), fp8's scale (a 1-entry fp32 tensor, else None) and the values as decoded, in
    ``values``' dtype."""
    if name == "fp32":
        return values, None, values
    wide = values.dtype
    if name == "fp8_e4m3":
        finite = torch.nan_to_num(values.float().abs(), nan=0.0, posinf=0.0, neginf=0.0)
        amax = finite.amax().reshape(1) if values.numel() else finite.new_zeros(1)
        scale = torch.where(amax > 0, amax / FP8_MAX, 1.0)
        narrow_values = (values.float() / scale).to(_WIRE[name])
        rounded = (narrow_values.float() * scale).to(wide)
    else:
        scale = None
        narrow_values = values.to(_WIRE[name])
        rounded = narrow_values.to(wide)
    return narrow_values.unsqueeze(-1).view(torch.uint8), scale, rounded


def widen(wire: torch.Tensor, name: str, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The values of ``wire`` (``narrow``'s, or a stack of them with ``scale`` shaped ``(..., 1)``) in ``dtype``."""
    if name == "fp32":
        return wire.to(dtype)
    values = wire.view(_WIRE[name]).squeeze(-1)
    if name == "fp8_e4m3":
        return (values.float() * scale).to(dtype)
    return values.to(dtype)
