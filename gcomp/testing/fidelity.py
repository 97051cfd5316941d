"""The error models of ``gcomp.core.Fidelity`` (docs/add-a-method.md, "Error models") and the rounding allowed
beside them: each check takes float64 tensors and returns None, or a message naming the kind and an entry."""
from __future__ import annotations

import torch

DRAWS = 300  # draws of an unbiased method's result; its tolerance is 6 standard deviations of their mean
SIGMAS = 6


def precision(dtypes) -> tuple[float, float]:
    """``(eps, tiny)``, relative rounding and subnormal spacing, of the coarsest float of 16 bits or more."""
    infos = [torch.finfo(d) for d in set(dtypes) if d.is_floating_point and d.itemsize >= 2]
    return max(i.eps for i in infos), max(i.smallest_normal * i.eps for i in infos)


def sum_bound(terms: int, magnitude: torch.Tensor, eps: float, tiny: float) -> torch.Tensor:
    """The rounding of a ``terms``-term sum in any order and a cast of it; ``magnitude``: the terms' |.| summed."""
    return (terms + 1) * (eps * magnitude + tiny)


def mismatch(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor, what: str) -> str | None:
    """None when ``|actual - expected| <= bound`` everywhere, else a message about the first entry further off."""
    bad = ~((actual.double() - expected).abs() <= bound)
    if not bad.any():
        return None
    i = int(bad.nonzero()[0])
    return (f"{what}: {int(bad.sum())} of {bad.numel()} entries off; first at {i}: got {actual[i].item()!r}, "
            f"expected {expected[i].item()!r} within {bound[i].item():.3g}")


def block_max(magnitude: torch.Tensor, block: int) -> torch.Tensor:
    """Per entry, the largest ``magnitude`` of any ``block`` consecutive entries holding it (0: the whole)."""
    if block == 1:
        return magnitude
    if block <= 0 or block >= magnitude.numel():
        return magnitude.max().expand_as(magnitude)
    return torch.nn.functional.max_pool1d(magnitude.view(1, 1, -1), 2 * block - 1, 1, block - 1).view(-1)


def check_sum(fidelity, result: torch.Tensor, inputs: torch.Tensor, dtypes, what: str) -> str | None:
    """``exact`` and ``relative``: the result against the sum of ``inputs`` (``(world, n)``); ``dtypes``: the
    bucket's and the payload's."""
    world, magnitude = inputs.shape[0], inputs.abs().sum(0)
    eps, tiny = precision(dtypes)
    bound = sum_bound(world, magnitude, eps, tiny)
    if fidelity.kind == "relative":
        bound = bound + fidelity.bound * (world + 1) * block_max(magnitude, fidelity.block)
    return mismatch(result, inputs.sum(0), bound, f"fidelity {fidelity.kind}: {what}")


def check_alone(fidelity, x: torch.Tensor, c: torch.Tensor, what: str) -> str | None:
    """``largest`` and ``contraction``: one rank's input ``x``, and ``c``, the method's result on it alone."""
    where = f"fidelity {fidelity.kind}: {what}"
    if fidelity.kind == "largest":
        sent = c != 0
        off = mismatch(c[sent], x[sent], fidelity.bound * x[sent].abs(), f"{where}: a sent entry")
        if off is not None:
            return off
        if sent.any() and not sent.all() and x[~sent].abs().max() > x[sent].abs().min():
            return (f"{where}: an entry of magnitude {x[~sent].abs().max().item():.6g} was left out while one of "
                    f"{x[sent].abs().min().item():.6g} was sent ({int(sent.sum())} of {x.numel()} sent)")
        return None
    eps, tiny = precision([c.dtype])
    err, norm = (x - c.double()).square().sum().item(), x.square().sum().item()
    allowed = (1 - fidelity.bound) * norm * (1 + 4 * eps) + x.numel() * tiny ** 2
    if not err <= allowed:
        return f"{where}: |x - C(x)|^2 = {err:.6g} > (1 - {fidelity.bound}) |x|^2 = {(1 - fidelity.bound) * norm:.6g}"
    return None


def check_draws(draws: torch.Tensor, inputs: torch.Tensor, dtypes, what: str, share: float = 0.0) -> str | None:
    """``unbiased``: ``draws`` (``(DRAWS, n)``) of the sum of ``inputs`` (``(world, n)``), off on at most a share
    ``share`` of the entries per rank; the variance is the largest of any entry's (an entry that drew one value every
    time is judged by its neighbours')."""
    mean, exact, (eps, tiny) = draws.mean(0), inputs.sum(0), precision(dtypes)
    spread = SIGMAS * (draws.var(0, correction=0).max() / len(draws)).sqrt()
    bound = spread + sum_bound(2, inputs.abs().sum(0), eps, tiny)
    off = mismatch(mean, exact, bound, f"fidelity unbiased: {what}: the mean of {len(draws)} draws")
    if off is not None and share and int((~((mean - exact).abs() <= bound)).sum()) <= share * len(inputs) * len(mean):
        off = None
    if off is None and not (exact.abs() > bound).any():
        return f"fidelity unbiased: {what}: {len(draws)} draws bound no entry ({bound.max().item():.3g}): not checked"
    return off
