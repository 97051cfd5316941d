"""What a ``pactrain`` payload carries, kept local (``PackedCtx``), and how it is laid out: ``FlatView``, DDP's
flat bucket; FSDP2's rows, one per destination shard, are ``gcomp.compressors.pactrain_rows.RowsView``. The
compressor's one encoder and one decoder (``PacTrainCompressor.encode``, ``.decode``) take either."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from gcomp.packing.support import Support
from gcomp.packing.tracker import BucketTrack

TERNARY = "ternary"  # two rounds: the exact shared scale first
ONE_ROUND = "ternary1"  # one round: the scale carried from the step before (``scale_grid``)


@dataclass
class PackedCtx:
    """One payload's context: ``mode`` (the tracker's ``tracking``, ``dense`` or ``packed``, or ``TERNARY``,
    ``ONE_ROUND``), the layout's ``track``, the ``bucket`` (the tensor compressed), ``view`` (how it is laid out),
    and for one round the carried scale it encoded against (``exponents``, ``scale``). ``face``: the support the
    ternary codec encodes, ``lay_out``: how its codes are packed (None: the codec's own flat lanes), ``words``: the
    code words in the lanes (``FlatView.ternary``, ``RowsView.ternary``)."""

    mode: str
    track: BucketTrack
    bucket: torch.Tensor
    view: Any
    exponents: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    face: Support | None = None
    lay_out: Callable[[torch.Tensor], torch.Tensor] | None = None
    words: int = 0


class FlatView:
    """DDP's bucket, flat: the bucket itself while tracking or dense; packed, its kept entries (the frozen
    support's order) and one changed entry; ternary, the codec's own flat lanes over the support."""

    in_rows = False  # an all-reduce takes every tensor whole (``Payload.whole`` is for rows)

    def build(self, device) -> None:
        """The tracker's own supports (``SupportIndex``, ``GroupSupport``)."""
        return None

    def dense(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def packed(self, support: Support, state, tensor: torch.Tensor) -> torch.Tensor:
        if state.packed is None:
            state.packed = tensor.new_empty(support.kept + 1)
        return support.gather(tensor, state.packed)

    def ternary(self, support: Support, codec) -> tuple[Support, Support, int]:
        """The support the codec encodes, the one it decodes, and the code words of the lanes."""
        return support, support, codec.words(support.kept)

    def lay_out(self, support: Support, state, device) -> None:
        return None

    def lanes(self, words: int, device) -> torch.Tensor:
        """The code words of a two-round payload, filled by ``second_round``."""
        return torch.empty(words, dtype=torch.int64, device=device)

    def result(self, received: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return received

    def unpack(self, support: Support, values: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return support.scatter(values, out)


FLAT = FlatView()
