"""How far a compressed result may be from its expectation: the rounding of the wire dtype, and a message
naming the first entry that is further off."""
from __future__ import annotations

import torch


def wire_precision(tensors, bucket_dtype: torch.dtype) -> tuple[float, float]:
    """``(eps, tiny)`` of the coarsest floating dtype among the payload tensors and the bucket.

    ``eps`` is the relative rounding of one operation in that dtype; ``tiny`` the spacing of its subnormals
    (the absolute rounding near zero).
    """
    dtypes = {t.dtype for t in tensors if t.is_floating_point()} | {bucket_dtype}
    infos = [torch.finfo(d) for d in dtypes]
    return max(i.eps for i in infos), max(i.smallest_normal * i.eps for i in infos)


def sum_bound(terms: int, magnitude: torch.Tensor, eps: float, tiny: float) -> torch.Tensor:
    """Elementwise bound on the rounding of a ``terms``-term sum (in any order) plus a cast of the result.

    ``magnitude`` is the sum of the absolute values of the terms (float64).
    """
    return (terms + 1) * (eps * magnitude + tiny)


def mismatch(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor, what: str) -> str | None:
    """None when ``|actual - expected| <= bound`` everywhere (float64), else a message about the first miss."""
    err = (actual.double() - expected).abs()
    bad = ~(err <= bound)
    if not bad.any():
        return None
    i = int(bad.nonzero()[0])
    return (f"{what}: {int(bad.sum())} of {bad.numel()} entries off; first at {i}: got {actual[i].item()!r}, "
            f"expected {expected[i].item()!r} within {bound[i].item():.3g}")


def require_within(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    """``mismatch``, raised as AssertionError."""
    message = mismatch(actual, expected, bound, what)
    if message is not None:
        raise AssertionError(message)
