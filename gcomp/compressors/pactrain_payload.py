"""What a ``pactrain`` payload carries, kept local: its mode, its layout's track, and the face of the support its
ternary codec encodes, for DDP's flat bucket (``gcomp.compressors.pactrain``) and for FSDP2's rows
(``gcomp.compressors.pactrain_rows``) alike."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from gcomp.packing.support import Support
from gcomp.packing.tracker import BucketTrack

TERNARY = "ternary"  # two rounds: the exact shared scale first
ONE_ROUND = "ternary1"  # one round: the scale carried from the step before (``scale_grid``)


@dataclass
class PackedCtx:
    """One payload's context: ``mode`` (the tracker's ``tracking``, ``dense`` or ``packed``, or ``TERNARY``,
    ``ONE_ROUND``), the layout's ``track``, the ``bucket`` (the tensor compressed, which DDP's decode writes
    into), and for one round the carried scale it encoded against (``exponents``, ``scale``). ``face``: the support
    the ternary codec encodes (the frozen support itself under DDP; FSDP2's ``TernaryRows.values``) and ``lay_out``:
    how its codes are packed (None: the codec's own flat lanes; FSDP2: one row per destination shard)."""

    mode: str
    track: BucketTrack
    bucket: torch.Tensor
    exponents: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    face: Support | None = None
    lay_out: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __post_init__(self):
        if self.face is None:
            self.face = self.track.support
