"""What the mask tracker keeps per bucket layout (``BucketTrack``), and, typed, what a packing method keeps with
it (``LayoutState``): what it carries to the next step and saves with the tracker (``Carry``), the ternary codec's
work buffers (``TernaryWork``) and the lossless packed buffer.

A ``LayoutState`` belongs to the layout's frozen support: when the track unfreezes (some rank's masks changed) the
tracker replaces it by an empty one, so nothing computed on the old support is used on the new one. Only the
carry's ``residual`` and ``exponents`` are checkpointed (``gcomp.packing.checkpoint``); the work buffers are
memory, allocated again at the first step that needs them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from gcomp.packing.support import Support

TRACKING, PACKED, DENSE = "tracking", "packed", "dense"


@dataclass(slots=True)
class Carry:
    """What the ternary path carries from one step of a frozen support to the next (``gcomp.compressors.
    pactrain_ternary``). ``residual`` and ``exponents`` are saved with the tracker; ``scale`` follows from
    ``exponents`` and ``resync`` is read at the next step."""

    # fp32, one entry per kept value (``support.kept``): added to the next step's values. With error feedback
    # what the codes did not carry; in one round without it (and without clipping), the excess a carried scale
    # clipped (``value - clamp(value, -scale, scale)``), used once
    residual: torch.Tensor | None = None
    # int64, one per parameter segment: the grid exponents of the shared scale the next step encodes against
    # in one round (``scale_grid``); None before the first shared scale, and after a resync
    exponents: torch.Tensor | None = None
    scale: torch.Tensor | None = None  # fp32, ``scale_grid.grid_scale(exponents)``; None until first needed
    # a one-round step's "some rank asks a resync" flag, a bool tensor as decoded; the tracker sends it to the host
    # with its own flags (``host_flags.receive_changed``: then a ``Slot`` of them), the next step reads it and then
    # takes the exact scale in two rounds
    resync: Any = None


@dataclass(slots=True)
class TernaryWork:
    """The ternary codec's work buffers for one frozen support, allocated at its first ternary step (fresh
    allocations of tens of MB cost more in page faults than the arithmetic done in them). ``prob`` and
    ``codes`` are as long as the lanes' fields (``F = packed_words(kept, b) * fields_per_word(b)``, b the lane
    width): codes are packed in place with their zero padding, and ``prob`` receives every unpacked field."""

    values: torch.Tensor  # fp32 (kept,): the kept entries, residual added
    draws: torch.Tensor  # fp32 (kept,): the random draws; a 16-bit bucket's gather and decode use its storage
    prob: torch.Tensor  # fp32 (F,): |value|, then the hit probabilities, the decoded fields
    hit: torch.Tensor  # bool (kept,): which entries send a non-zero code
    codes: torch.Tensor  # uint8 (F,), zero-initialised: t + 1 per kept entry, then zero padding
    bernoulli: dict = field(default_factory=dict)  # ``bernoulli.draw_hits``' own work buffers (its draws: ``draws``)
    # FSDP2 only (``gcomp.compressors.pactrain_rows``): uint8 (world, F_row), each destination row's codes before packing,
    # zero where no code goes
    rows: torch.Tensor | None = None


@dataclass(slots=True)
class LayoutState:
    """Everything a packing method keeps for one bucket layout's frozen support; dropped with it."""

    carry: Carry = field(default_factory=Carry)
    ternary: TernaryWork | None = None  # allocated by the ternary codec's first step on this support
    # the lossless packed buffer: DDP (kept + 1,) in the bucket's dtype, the last entry counting ranks whose
    # masks changed; FSDP2 (world, K + 1), one such row per destination shard
    packed: torch.Tensor | None = None


@dataclass
class BucketTrack:
    """The tracker's state for one bucket layout."""

    mode: str = TRACKING
    stable: int = 0  # consecutive steps in which no rank's masks changed
    signature: tuple | None = None
    # [any rank changed, digests agree(, some rank asks a resync)] on their way to the host (``host_flags.HostFlags``)
    pending: Any = None
    candidate: Support | None = None
    support: Support | None = None
    state: LayoutState = field(default_factory=LayoutState)  # the method's, dropped with the support
    # a packed bucket's masks as they were when it froze (``gcomp.packing.mask_check``: a digest, or on the device
    # path a bool copy)
    mask_digest: torch.Tensor | None = None
    unchecked: int = 0  # packed steps since the masks were last compared with ``mask_digest``
    fresh: bool = False  # made for a new layout, not restored: its first step may send a candidate at once
    names: tuple[str, ...] = ()  # the layout's parameters, in its order (saved with the track)

    def unfreeze(self) -> None:
        """Back to tracking from scratch: the support goes, and with it everything the method kept on it."""
        self.mode, self.stable, self.support, self.state = TRACKING, 0, None, LayoutState()
