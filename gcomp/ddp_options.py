"""Options for building ``DistributedDataParallel`` that differ between torch versions."""
from __future__ import annotations

import functools
import inspect

from torch.nn.parallel import DistributedDataParallel


@functools.cache
def _has_forward_sync_buffers() -> bool:
    return "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters


def no_buffer_sync() -> dict:
    """DDP keyword arguments that stop DDP from broadcasting the module's buffers from rank 0 at every forward.

    Pruned models need them: ``torch.nn.utils.prune`` keeps each mask as a buffer as large as its weight, so DDP
    would otherwise re-send every mask at every forward (``gcomp.pruning.prune`` makes them equal on every rank
    already). Use as ``DistributedDataParallel(model, **no_buffer_sync())``.

    - torch 2.13 and later: ``{"forward_sync_buffers": False}``. ``broadcast_buffers`` is deprecated there
      (a FutureWarning at every construction). The buffers are still broadcast once, from rank 0, when DDP is
      built (``init_sync``), unlike with ``broadcast_buffers=False``: buffers that must differ between ranks
      from the start have to be set after DDP is built.
    - older torch, whose DDP has no ``forward_sync_buffers``: ``{"broadcast_buffers": False}`` (no buffer sync
      at construction either).

    The choice is made from DDP's signature, not from the version number.
    """
    if _has_forward_sync_buffers():
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}
