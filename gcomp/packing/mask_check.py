"""What a packed bucket's masks are compared with every ``check_every`` steps (an edit through ``mask.data`` leaves
``_version`` as it was, so only their contents tell), without a host synchronisation on the device path.

The CPU path keeps a digest of the kept positions (``masks_digest``: int64 (hash, count), 16 bytes) and compares
it on the host. On the device path (``gcomp.kernels.on_device``) the digest's ``nonzero`` and the comparison would
each wait for the device, so the bucket keeps a bool copy of its masks instead (1 byte per masked entry, on the
masks' device), and the comparison is a 0-d bool tensor on the device: it rides in the packed payload's changed
entry as the answer always did, and is read on the host with the step's flags at the next step.
"""
from __future__ import annotations

import torch

from gcomp.kernels import on_device
from gcomp.pruning.masks import masks_digest


def mask_state(masks: list[torch.Tensor], like: torch.Tensor | None = None) -> torch.Tensor:
    """The masks as a frozen bucket remembers them: a host digest, or on the device path (or where ``like``, an
    earlier state, is such a copy) a bool copy of every entry, mask after mask."""
    device_path = like.dtype == torch.bool if like is not None else bool(masks) and on_device(masks[0])
    if not device_path:
        return masks_digest(masks).cpu()
    if not masks:
        return torch.zeros(0, dtype=torch.bool)
    # a view per mask (no kernel), one cat, one comparison
    return torch.cat([m.detach().reshape(-1) for m in masks]).ne(0)


def masks_differ(now: torch.Tensor, then: torch.Tensor) -> bool | torch.Tensor:
    """Whether the masks changed between two ``mask_state``s of the same kind: a bool (host digests), or a 0-d bool
    tensor on the masks' device (bool copies: no host synchronisation)."""
    if then.dtype != torch.bool:
        return not torch.equal(now, then)
    if now.shape != then.shape:
        return True
    return now.ne(then).any()
