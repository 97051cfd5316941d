"""Structured pruning by ADMM during training (PruneX's H-SADMM; docs/prunex.md, docs/algorithms.md §10.3). DDP
keeps W identical on every rank, so each computes Z and U locally; only the kept groups are broadcast from ``src``
at each projection, so every rank holds the same mask whatever its floating-point rounding."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear
from torch.nn.utils import prune as torch_prune

from gcomp.pruning.masks import check_masks_agree, comm_device, is_distributed, mask_of, masks_digest, top_mask
from gcomp.pruning.prune import _LAYERS, PruneResult, _orig

STRUCTURES = ("filters", "channels")


@dataclass
class _Target:
    name: str
    module: nn.Module
    weight: nn.Parameter
    bias: nn.Parameter | None  # in the group of its filter (structure "filters" only)
    kappa: int  # groups kept
    z_weight: torch.Tensor
    u_weight: torch.Tensor
    z_bias: torch.Tensor | None
    u_bias: torch.Tensor | None
    keep: torch.Tensor  # bool per group: the support of Z


class StructuredADMM:
    """ADMM towards a model whose targeted layers keep ``1 - sparsity`` of their filters (dim 0, with the filter's
    bias entry) or input channels (``structure="channels"``, dim 1): ``max(1, round((1 - sparsity) * groups))``
    groups, the largest by L2 norm of ``W + U`` (ties: the lower index). ``layers``: the Conv/Linear modules to
    prune, by default all but the last (filters) or the first (channels). Call it on every rank of ``group`` in
    the same order (a broadcast from ``src`` per projection); ``rho`` grows by ``rho_growth`` per projection.
    """

    def __init__(self, model: nn.Module, sparsity: float = 0.6, *, rho: float = 0.01, interval: int = 50,
                 structure: str = "filters", layers: list[str] | None = None, rho_growth: float = 1.0,
                 group=None, src: int = 0):
        _check(sparsity, rho, interval, structure, rho_growth)
        self.sparsity, self.rho, self.interval = float(sparsity), float(rho), int(interval)
        self.structure, self.rho_growth, self.group, self.src = structure, float(rho_growth), group, src
        self.steps, self.pruned = 0, False
        self.targets = [self._target(name, module) for name, module in _choose(model, structure, layers)]
        self.update(dual=False)  # Z = proj(W), U = 0

    def _target(self, name: str, module: nn.Module) -> _Target:
        if "weight_orig" in module._parameters:
            raise ValueError(f"layer {name!r} is already pruned; StructuredADMM starts from an unpruned model")
        weight = _orig(module)
        bias = module._parameters.get("bias") if self.structure == "filters" else None
        dim = self._dim
        if weight.dim() < dim + 1 or weight.size(dim) == 0:
            raise ValueError(f"layer {name!r} has no {self.structure} to prune (weight shape {tuple(weight.shape)})")
        groups = weight.size(dim)
        kappa = max(1, round((1 - self.sparsity) * groups))
        zeros = torch.zeros_like
        return _Target(name, module, weight, bias, kappa, zeros(weight, requires_grad=False),
                       zeros(weight, requires_grad=False), None if bias is None else zeros(bias, requires_grad=False),
                       None if bias is None else zeros(bias, requires_grad=False),
                       torch.ones(groups, dtype=torch.bool, device=weight.device))

    @property
    def _dim(self) -> int:
        return 0 if self.structure == "filters" else 1

    def _along(self, t: _Target) -> list[int]:
        """The shape that broadcasts a per-group tensor along ``t``'s weight."""
        shape = [1] * t.weight.dim()
        shape[self._dim] = -1
        return shape

    # --- per step ---------------------------------------------------------------------------------------------

    def penalty(self) -> torch.Tensor:
        """``rho / 2 * sum ||W - Z + U||^2`` over the targeted weights (and biases): add it to the loss."""
        if self.pruned:
            raise RuntimeError("StructuredADMM.penalty() after prune(): the model is hard-pruned, train it plainly")
        total = None
        for t in self.targets:
            term = (t.weight - t.z_weight + t.u_weight).pow(2).sum()
            if t.bias is not None:
                term = term + (t.bias - t.z_bias + t.u_bias).pow(2).sum()
            total = term if total is None else total + term
        return total * (self.rho / 2)

    def step(self) -> bool:
        """Count one optimizer step; every ``interval`` steps, update Z and U. Returns True when it did."""
        if self.pruned:
            raise RuntimeError("StructuredADMM.step() after prune()")
        self.steps += 1
        if self.steps % self.interval:
            return False
        self.update()
        return True

    @torch.no_grad()
    def update(self, dual: bool = True) -> None:
        """``Z = proj(W + U)``, then ``U = U + W - Z`` (with ``dual=False``, U stays 0: the initial Z)."""
        dim = self._dim
        keeps = []
        for t in self.targets:
            x_weight, x_bias = t.weight + t.u_weight, None if t.bias is None else t.bias + t.u_bias
            norms = x_weight.detach().transpose(0, dim).reshape(x_weight.size(dim), -1).double().pow(2).sum(1)
            if x_bias is not None:
                norms += x_bias.detach().double().pow(2)
            keeps.append(top_mask(norms, t.kappa))
        keeps = self._agree(keeps)
        for t, keep in zip(self.targets, keeps):
            t.keep = keep
            x_weight = t.weight + t.u_weight
            torch.mul(x_weight, keep.view(self._along(t)), out=t.z_weight)
            if dual:
                torch.sub(x_weight, t.z_weight, out=t.u_weight)
            if t.bias is not None:
                x_bias = t.bias + t.u_bias
                torch.mul(x_bias, keep, out=t.z_bias)
                if dual:
                    torch.sub(x_bias, t.z_bias, out=t.u_bias)
        if dual:
            self.rho *= self.rho_growth

    def _agree(self, keeps: list[torch.Tensor]) -> list[torch.Tensor]:
        if not is_distributed(self.group):
            return keeps
        flat = torch.cat(keeps).to(comm_device(self.group, keeps[0].device), torch.uint8)
        src = self.src if self.group is None else dist.get_global_rank(self.group, self.src)
        dist.broadcast(flat, src=src, group=self.group)
        return [k.to(keeps[0].device).bool() for k in flat.split([k.numel() for k in keeps])]

    # --- diagnostics ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def pruned_norm(self) -> float:
        """``||W|| on the groups outside support(Z) / ||W||`` over the targets: what a hard prune would cut."""
        cut = whole = 0.0
        for t in self.targets:
            dropped = ~t.keep
            cut += float((t.weight * dropped.view(self._along(t))).double().pow(2).sum())
            whole += float(t.weight.double().pow(2).sum())
            if t.bias is not None:
                cut += float((t.bias * dropped).double().pow(2).sum())
                whole += float(t.bias.double().pow(2).sum())
        return math.sqrt(cut / whole) if whole else 0.0

    # --- the end ----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def prune(self, optimizer: torch.optim.Optimizer | None = None) -> PruneResult:
        """Hard prune every target to support(Z) through ``torch.nn.utils.prune`` and check all ranks hold the same
        masks; ``optimizer``: its per-parameter state is zeroed on the pruned groups too (else momentum keeps
        moving the pruned ``weight_orig`` entries)."""
        if self.pruned:
            raise RuntimeError("StructuredADMM.prune() was already called")
        masks, removed, total = {}, 0, 0
        for t in self.targets:
            for attr, param, keep in (("weight", t.weight, t.keep.view(self._along(t))), ("bias", t.bias, t.keep)):
                if param is None:
                    continue
                mask = keep.expand_as(param).to(param.dtype).contiguous()
                param.mul_(mask)
                if optimizer is not None:
                    for value in optimizer.state.get(param, {}).values():
                        if isinstance(value, torch.Tensor) and value.shape == param.shape:
                            value.mul_(mask)
                torch_prune.custom_from_mask(t.module, attr, mask)
                name = f"{t.name}.{attr}_orig" if t.name else f"{attr}_orig"
                masks[name] = mask_of(t.module, f"{attr}_orig")
                removed += int(mask.numel() - mask.count_nonzero())
                total += mask.numel()
        self.pruned = True
        if is_distributed(self.group):
            digest = check_masks_agree(masks.values(), self.group)
        else:
            digest = tuple(masks_digest(masks.values()).tolist())
        return PruneResult(masks=masks, removed=removed, total=total, digest=digest)

    # --- checkpoint -------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"rho": self.rho, "steps": self.steps, "pruned": self.pruned,
                "targets": {t.name: {"z_weight": t.z_weight, "u_weight": t.u_weight, "z_bias": t.z_bias,
                                     "u_bias": t.u_bias, "keep": t.keep} for t in self.targets}}

    def load_state_dict(self, state: dict) -> None:
        names = [t.name for t in self.targets]
        if sorted(state["targets"]) != sorted(names):
            raise ValueError(f"checkpoint targets {sorted(state['targets'])}, this ADMM targets {sorted(names)}")
        self.rho, self.steps, self.pruned = state["rho"], state["steps"], state["pruned"]
        for t in self.targets:
            saved = state["targets"][t.name]
            for key in ("z_weight", "u_weight", "z_bias", "u_bias", "keep"):
                if getattr(t, key) is not None:
                    getattr(t, key).copy_(saved[key])


def _check(sparsity, rho, interval, structure, rho_growth) -> None:
    def real(x):
        return isinstance(x, numbers.Real) and not isinstance(x, bool)

    if not real(sparsity) or not 0 <= sparsity < 1:
        raise ValueError(f"sparsity must be a real number in [0, 1), got {sparsity!r}")
    if not real(rho) or not 0 < rho < math.inf:
        raise ValueError(f"rho must be a finite number > 0, got {rho!r}")
    if isinstance(interval, bool) or not isinstance(interval, numbers.Integral) or interval < 1:
        raise ValueError(f"interval must be an integer >= 1, got {interval!r}")
    if structure not in STRUCTURES:
        raise ValueError(f"unknown structure {structure!r}; choose one of {', '.join(STRUCTURES)}")
    if not real(rho_growth) or not 1 <= rho_growth < math.inf:
        raise ValueError(f"rho_growth must be a finite number >= 1, got {rho_growth!r}")


def _choose(model: nn.Module, structure: str, layers: list[str] | None) -> list[tuple[str, nn.Module]]:
    found = [(name, m) for name, m in model.named_modules()
             if isinstance(m, _LAYERS) and not isinstance(m, NonDynamicallyQuantizableLinear)]
    if layers is None:
        if len(found) < 2:
            raise ValueError("the model needs at least two Conv/Linear layers (the last, or for channels the "
                             "first, is left whole by default); pass 'layers' to choose them")
        return found[:-1] if structure == "filters" else found[1:]
    by_name = dict(found)
    missing = [n for n in layers if n not in by_name]
    if missing:
        raise ValueError(f"'layers' names no Conv/Linear module: {missing}; the model has {list(by_name)}")
    if not layers:
        raise ValueError("'layers' is empty")
    return [(n, by_name[n]) for n in dict.fromkeys(layers)]
