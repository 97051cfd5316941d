"""One-shot unstructured pruning (PacTrain Phase A, docs/pactrain.md): rank weights, keep the top, install masks
on every rank (``custom_from_mask``; ``weight_orig`` is zeroed where the mask is, so weight decay, Adam(W) and
``prune.remove`` keep pruned weights at exactly 0)."""
from __future__ import annotations

import copy
import math
import numbers
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear
from torch.nn.utils import prune as torch_prune

from gcomp.pruning.entry import check_entered
from gcomp.pruning.grasp import grasp_scores
from gcomp.pruning.masks import check_masks_agree, comm_device, is_distributed, mask_of, masks_digest, top_mask

METHODS = ("grasp", "magnitude", "random")
SCOPES = ("global", "layer")
_LAYERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)


@dataclass(frozen=True)
class PruneResult:
    """What :func:`prune` did: ``masks`` (``{"0.weight_orig": the model's mask buffer, ...}``), ``removed`` and
    ``total`` prunable weights, and ``digest`` (``masks_digest`` of the masks, equal on every rank)."""

    masks: dict[str, torch.Tensor]
    removed: int
    total: int
    digest: tuple[int, int]

    @property
    def kept_fraction(self) -> float:
        """The fraction of the prunable weights that is kept."""
        return 1.0 - self.removed / self.total


# --- arguments and layers ---------------------------------------------------------------------------------------

def _check_args(ratio, method, scope, temperature, samples_per_class) -> None:
    if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real) or not 0 <= ratio < 1:  # NaN fails too
        raise ValueError(f"ratio must be a real number in [0, 1), got {ratio!r}")
    if method not in METHODS:
        raise ValueError(f"unknown pruning method {method!r}; choose one of {', '.join(METHODS)}")
    if scope not in SCOPES:
        raise ValueError(f"unknown pruning scope {scope!r}; choose one of {', '.join(SCOPES)}")
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) \
            or not 0 < temperature < math.inf:
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if isinstance(samples_per_class, bool) or not isinstance(samples_per_class, numbers.Integral) \
            or samples_per_class < 1:
        raise ValueError(f"samples_per_class must be an integer >= 1, got {samples_per_class!r}")


def _prunable_layers(model: nn.Module, include_embeddings: bool) -> list[tuple[str, nn.Module]]:
    kinds = _LAYERS + ((nn.Embedding,) if include_embeddings else ())
    layers, owners = [], {}
    for name, module in model.named_modules():
        # MultiheadAttention reads out_proj.weight directly, never calling out_proj's forward (and its
        # pruning pre-hook), so a mask there would be silently ignored.
        if not isinstance(module, kinds) or isinstance(module, NonDynamicallyQuantizableLinear):
            continue
        weight = _orig(module)
        if id(weight) in owners:
            raise ValueError(f"{owners[id(weight)]!r} and {name!r} share one weight; pruning tied weights is not "
                             "supported (the second module would bypass the mask)")
        owners[id(weight)] = name
        layers.append((name, module))
    return layers


def _orig(module: nn.Module) -> torch.Tensor:
    """The trainable weight: ``weight_orig`` when already pruned, else ``weight``."""
    return module._parameters.get("weight_orig", module._parameters.get("weight"))


def _old_mask(module: nn.Module) -> torch.Tensor | None:
    return module._buffers.get("weight_mask") if "weight_orig" in module._parameters else None


def _param_name(module_name: str) -> str:
    return f"{module_name}.weight_orig" if module_name else "weight_orig"


# --- scores and selection ---------------------------------------------------------------------------------------

def _effective(module: nn.Module) -> torch.Tensor:
    mask = _old_mask(module)
    w = _orig(module).detach()
    return w if mask is None else w * mask


def _removal_scores(model, layers, method, data, temperature, samples_per_class, seed) -> list[torch.Tensor]:
    """Per layer, a score per weight: the larger, the sooner it is removed."""
    if method == "magnitude":
        return [-_effective(m).abs() for _, m in layers]
    if method == "random":
        sizes = [_orig(m).numel() for _, m in layers]
        noise = torch.rand(sum(sizes), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        return list(noise.split(sizes))
    if data is None:
        raise ValueError("method='grasp' needs data: a tuple (inputs, targets) or an iterable of such batches")
    # A pruned module's `weight` is a non-leaf tensor, which deepcopy refuses; the copy recomputes it from
    # weight_orig * weight_mask in its pre-hook anyway, so hand deepcopy a detached stand-in.
    memo = {id(m.weight): m.weight.detach() for _, m in layers if _old_mask(m) is not None}
    twin = copy.deepcopy(model, memo)
    twin.eval()  # no dropout noise between the passes (and no global RNG); BN uses its pre-trained statistics
    weights = [_orig(twin.get_submodule(name)) for name, _ in layers]
    for w in weights:
        w.requires_grad_(True)
    with torch.enable_grad():  # double backprop, even when called under torch.no_grad()
        return grasp_scores(twin, weights, data, temperature, samples_per_class)


def _keep_mask(model, layers, ratio, method, data, scope, temperature, samples_per_class, seed) -> torch.Tensor:
    """The new flat keep-mask (bool, layers concatenated in logical layout)."""
    scores = _removal_scores(model, layers, method, data, temperature, samples_per_class, seed)
    device = scores[0].device
    dtype = torch.promote_types(torch.float32, scores[0].dtype)
    for s in scores[1:]:
        dtype = torch.promote_types(dtype, s.dtype)
    flat = torch.cat([s.detach().reshape(-1).to(device, dtype) for s in scores])
    if bool(flat.isnan().any()):
        raise RuntimeError(f"{method} scores contain NaN; cannot rank the weights")
    olds = [_old_mask(m) for _, m in layers]
    pruned = torch.cat([torch.zeros(_orig(m).numel(), dtype=torch.bool, device=device) if o is None
                        else (o.reshape(-1) == 0).to(device) for (_, m), o in zip(layers, olds)])
    flat.masked_fill_(pruned, math.inf)  # already pruned: removed first, so they stay pruned
    if scope == "global":
        groups = [(0, flat.numel())]
    else:
        bounds = [0]
        for _, m in layers:
            bounds.append(bounds[-1] + _orig(m).numel())
        groups = list(zip(bounds[:-1], bounds[1:]))
    remove = torch.zeros_like(pruned)
    for a, b in groups:
        n = b - a
        already = int(pruned[a:b].sum())
        k = round(float(ratio) * n)
        if n and k >= n:
            what = "the model's prunable" if scope == "global" else f"layer {layers[groups.index((a, b))][0]!r}'s"
            raise ValueError(f"ratio={ratio} rounds up to all {n} of {what} weights, as ratio=1 would: a layer "
                             "without weights cuts the network; lower the ratio")
        if already > k:
            warnings.warn(f"{already} of {n} weights are already pruned, more than ratio={ratio} asks for "
                          f"({k}); they stay pruned", stacklevel=3)
        remove[a:b] = top_mask(flat[a:b], max(k, already))
    return ~remove


# --- distribution -----------------------------------------------------------------------------------------------

def _share(keep: torch.Tensor | None, total: int, failure: BaseException | None, group, src: int,
           device: torch.device) -> torch.Tensor:
    """Rank ``src``'s keep-mask on every rank; first agree on its size and on whether ``src`` computed it."""
    dev = comm_device(group, device)
    status = torch.tensor([total, -total, int(failure is not None)], dtype=torch.int64, device=dev)
    dist.all_reduce(status, op=dist.ReduceOp.MAX, group=group)
    if int(status[2]):
        if failure is not None:
            raise failure
        raise RuntimeError(f"rank {src} failed to compute the pruning masks (see its error)")
    if int(status[0]) != -int(status[1]):
        raise RuntimeError(f"ranks disagree on the number of prunable weights (between {-int(status[1])} and "
                           f"{int(status[0])}); prune the same model on every rank")
    buf = keep.to(dev, torch.uint8) if keep is not None else torch.empty(total, dtype=torch.uint8, device=dev)
    dist.broadcast(buf, src=src, group=group)
    return buf.to(device).bool()


# --- applying ---------------------------------------------------------------------------------------------------

def _apply(layers, keep: torch.Tensor) -> None:
    offset = 0
    for _, module in layers:
        w = _orig(module)
        mask = keep[offset:offset + w.numel()].reshape(w.shape).to(w.device)  # logical layout
        offset += w.numel()
        with torch.no_grad():
            w.mul_(mask)  # in place: keeps the Parameter, its memory format and optimizer references
        # On an already pruned module this makes a PruningContainer whose mask is old * new == new, because
        # the new mask keeps none of the old zeros.
        torch_prune.custom_from_mask(module, "weight", mask)


def prune(model: nn.Module, ratio: float, method: str = "grasp", data=None, scope: str = "global", *,
          group=None, src: int = 0, temperature: float = 200.0, samples_per_class: int = 10,
          include_embeddings: bool = False, seed: int = 0, enter_timeout: float = 60.0) -> PruneResult:
    """Prune the ``weight`` of every Conv1d/2d/3d and Linear (and Embedding if ``include_embeddings``).

    ``ratio`` in [0, 1): exactly ``round(ratio * n)`` of them are pruned afterwards, over all (``scope="global"``)
    or per layer (``"layer"``), already pruned ones included. ``method``: ``"grasp"`` (largest ``-theta * Hg``
    removed, on an eval-mode copy; needs ``data``, a tuple (inputs, targets) or an iterable of them),
    ``"magnitude"`` (smallest ``|w|``) or ``"random"`` (seeded by ``seed``).

    With several ranks in ``group``, call it on every one, before DDP: each checks that all entered within
    ``enter_timeout`` seconds with the same arguments (``data`` and ``seed`` aside: only ``src`` reads them),
    then ``src`` computes the masks and broadcasts them, and all ranks check they hold the same ones.
    """
    if isinstance(enter_timeout, bool) or not isinstance(enter_timeout, numbers.Real) \
            or not 0 < enter_timeout < math.inf:
        raise ValueError(f"enter_timeout must be a finite number of seconds > 0, got {enter_timeout!r}")
    distributed = is_distributed(group)
    if distributed:
        check_entered("gcomp.pruning.prune", group, {
            "ratio": ratio, "method": method, "scope": scope, "temperature": temperature,
            "samples_per_class": samples_per_class, "include_embeddings": include_embeddings, "src": src},
            float(enter_timeout))
    _check_args(ratio, method, scope, temperature, samples_per_class)
    layers = _prunable_layers(model, include_embeddings)
    if not layers:
        kinds = "Conv1d/2d/3d, Linear" + (", Embedding" if include_embeddings else "")
        raise ValueError(f"the model has no prunable layer ({kinds})")
    total = sum(_orig(m).numel() for _, m in layers)
    device = _orig(layers[0][1]).device
    computing = not distributed or dist.get_rank() == src
    keep, failure = None, None
    if computing:
        try:
            keep = _keep_mask(model, layers, ratio, method, data, scope, temperature, samples_per_class, seed)
        except Exception as e:  # noqa: BLE001 -- re-raised below, after telling the other ranks
            if not distributed:
                raise
            failure = e
    if distributed:
        keep = _share(keep, total, failure, group, src, device)
    _apply(layers, keep)
    masks = {_param_name(name): mask_of(model, _param_name(name)) for name, _ in layers}
    if distributed:
        digest = check_masks_agree(masks.values(), group)
    else:
        digest = tuple(masks_digest(masks.values()).tolist())
    return PruneResult(masks=masks, removed=total - int(keep.sum()), total=total, digest=digest)


def kept_fraction(model: nn.Module) -> float:
    """The kept fraction of *all* parameters: a pruned weight counts its mask's ones, any other its size."""
    total = kept = 0
    for name, p in model.named_parameters():
        mask = mask_of(model, name)
        total += p.numel()
        kept += p.numel() if mask is None else int(mask.count_nonzero())
    if total == 0:
        raise ValueError("the model has no parameters")
    return kept / total
