"""The version bumps that DDP's own buffer broadcast gives the pruning masks, told apart from edits.

DDP re-sends the module's buffers from rank 0 at every forward unless built with ``no_buffer_sync()``; torch
up to 2.12 does it by an in-place copy into each buffer, which bumps its ``_version`` at every step (torch 2.13
leaves the versions alone). The mask tracker notices edits by identity and ``_version`` alone, on the host, so
on such a torch every mask looked edited at every step and no bucket stayed packed (seen on torch 2.11). A
copy of rank 0's masks is not an edit worth noticing on this rank: an edit on rank 0 bumps rank 0's version
there and is flagged by rank 0, and every rank then tracks again.

A forward pre-hook on the DDP model (before its broadcast) reads the masks' versions, and one on the module it
wraps (after it) counts what the broadcast added, per mask: ``discount`` is subtracted from the version.
"""
from __future__ import annotations

import torch
from torch import nn

from gcomp.pruning.masks import named_masks


class SyncBumps:
    """Per mask (by identity), how many version bumps DDP's buffer broadcast made since ``watch``."""

    def __init__(self):
        self.bumps: dict[int, int] = {}
        self._before: list[tuple[torch.Tensor, int]] = []
        self._handles: list = []

    def watch(self, ddp: nn.Module) -> None:
        """Count the bumps made between ``ddp``'s forward and its module's (its buffer broadcast); nothing to
        count, and no hook, when ``ddp`` does not re-send buffers at each forward (``no_buffer_sync()``:
        ``broadcast_buffers`` reads False, on torch 2.13 too, where it stands for ``forward_sync_buffers``)."""
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
        """The bumps of ``mask``'s ``_version`` that DDP's broadcast made."""
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
