"""Where a model's pruning masks live (``torch.nn.utils.prune``'s ``weight_orig`` and buffer ``weight_mask``), how
one is chosen from scores, a digest that tells whether ranks hold the same ones (``check_masks_agree``), and DDP's
buffer broadcasts: turned off (``no_buffer_sync``) or told from mask edits (``SyncBumps``)."""
from __future__ import annotations

import functools
import inspect
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

_ORIG = "_orig"
_MASK = "_mask"

# The digest: sum over kept positions p of ((p + 1) * A) mod P, which fits int64 for any bucket below 2**31
# elements, and the count of kept positions. Both are integers: equal on every rank or visibly not.
_DIGEST_A = 2654435761
_DIGEST_P = 4294967291


def mask_of(model: nn.Module, param_name: str) -> torch.Tensor | None:
    """The mask buffer of the parameter ``param_name``, or None if unpruned; a name taken before pruning renamed it
    (``"conv.weight"`` for ``"conv.weight_orig"``) finds it too, so a hook installed before pruning sees it."""
    module_name, _, attr = param_name.rpartition(".")
    try:
        module = model.get_submodule(module_name) if module_name else model
    except AttributeError:
        return None
    base = attr[: -len(_ORIG)] if attr.endswith(_ORIG) else attr
    if base + _ORIG not in module._parameters:
        return None
    return module._buffers.get(base + _MASK)


def parameter_of(model: nn.Module, param_name: str) -> torch.nn.Parameter:
    """The parameter ``param_name``, also under a name taken before pruning renamed it (see :func:`mask_of`)."""
    try:
        return model.get_parameter(param_name)
    except AttributeError:
        return model.get_parameter(param_name + _ORIG)


def named_masks(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{parameter name: mask}`` for every pruned parameter of ``model`` (names as in ``named_parameters()``)."""
    out = {}
    for name, _ in model.named_parameters():
        mask = mask_of(model, name)
        if mask is not None:
            out[name] = mask
    return out


def positions_digest(positions: torch.Tensor) -> torch.Tensor:
    """An int64 pair (hash, count) of a set of kept positions (int32 or int64, any order), on their device."""
    p = positions.reshape(-1).to(torch.int64)
    h = ((p + 1) * _DIGEST_A).remainder_(_DIGEST_P).sum()
    return torch.stack([h, torch.tensor(p.numel(), dtype=torch.int64, device=p.device)])


def masks_digest(masks: Iterable[torch.Tensor]) -> torch.Tensor:
    """A digest of a sequence of masks (their kept positions, concatenated in order, in logical layout)."""
    flat = [m.detach().reshape(-1) != 0 for m in masks]
    if not flat:
        return torch.zeros(2, dtype=torch.int64)
    return positions_digest(torch.cat(flat).nonzero().reshape(-1))


def top_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """A bool mask of the ``k`` largest of ``scores`` (1-D); among equal scores the lower indices come first."""
    n = scores.numel()
    if k <= 0:
        return torch.zeros(n, dtype=torch.bool, device=scores.device)
    if k >= n:
        return torch.ones(n, dtype=torch.bool, device=scores.device)
    tau = scores.kthvalue(n - k + 1).values
    above = scores > tau
    equal = scores == tau
    return above | (equal & (equal.cumsum(0) <= k - above.sum()))


def is_distributed(group=None) -> bool:
    """True when ``group`` (default: the world) has more than one rank to agree with."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def comm_device(group, fallback: torch.device) -> torch.device:
    """Where ``group``'s collectives want their tensors: ``fallback`` (a GPU) for NCCL, the CPU otherwise."""
    return fallback if dist.get_backend(group) == "nccl" else torch.device("cpu")


def check_masks_agree(masks, group=None) -> tuple[int, int]:
    """This rank's digest ``(hash, kept count)`` of ``masks``, or a RuntimeError unless every rank of ``group``
    holds the same (one MAX all-reduce of ``[digest, -digest]``)."""
    masks = list(masks)
    d = masks_digest(masks)
    dev = comm_device(group, masks[0].device if masks else torch.device("cpu"))
    both = torch.cat([d, -d]).to(dev)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    hi, lo = both[:2].tolist(), (-both[2:]).tolist()
    if hi != lo:
        raise RuntimeError(f"pruning masks differ across ranks: digests (hash, kept) range from {tuple(lo)} to "
                           f"{tuple(hi)}; this rank holds {tuple(d.tolist())}")
    return tuple(d.tolist())


@functools.cache
def _has_forward_sync_buffers() -> bool:
    return "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters


def no_buffer_sync() -> dict:
    """DDP keyword arguments that stop DDP re-sending every buffer (every mask) from rank 0 at each forward:
    ``{"forward_sync_buffers": False}`` where DDP's signature has it (torch 2.13 on; it still broadcasts them
    once, when DDP is built), else ``{"broadcast_buffers": False}`` (docs/pactrain.md)."""
    if _has_forward_sync_buffers():
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


# --- DDP's buffer broadcasts, told from mask edits ------------------------------------------------------------

class SyncBumps:
    """Per mask (by identity), the version bumps DDP's own buffer broadcast made since ``watch``: torch up to 2.12
    re-sends rank 0's buffers at each forward by an in-place copy, which bumps every mask's ``_version`` (torch 2.13
    does not). A copy of rank 0's masks is no edit: an edit on rank 0 is flagged by rank 0. A forward pre-hook on
    the DDP model (before its broadcast) reads the versions, one on the module it wraps (after it) counts the bumps."""

    def __init__(self):
        self.bumps: dict[int, int] = {}
        self._before: list[tuple[torch.Tensor, int]] = []
        self._handles: list = []

    def watch(self, ddp: nn.Module) -> None:
        """No hook when ``ddp`` does not re-send buffers (``no_buffer_sync()``: ``broadcast_buffers`` False)."""
        self.close()
        if not getattr(ddp, "broadcast_buffers", True):
            return
        module = ddp.module

        def before(_module, _inputs):
            self._before = [(m, m._version) for m in named_masks(module).values()]

        def after(_module, _inputs):
            for mask, version in self._before:
                if mask._version != version:
                    self.bumps[id(mask)] = self.bumps.get(id(mask), 0) + mask._version - version
            self._before = []

        self._handles = [ddp.register_forward_pre_hook(before), module.register_forward_pre_hook(after)]

    def discount(self, mask: torch.Tensor) -> int:
        return self.bumps.get(id(mask), 0)

    def version_of(self, mask: torch.Tensor) -> tuple[int, int]:
        """``mask``'s identity and its version less DDP's bumps: what replacing or editing it changes."""
        return id(mask), mask._version - self.discount(mask)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._before = [], []

    # a copy (a checkpoint's deepcopy, a pickled codec) watches nothing: its model is not the one watched
    def __deepcopy__(self, memo) -> "SyncBumps":
        return SyncBumps()

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()
