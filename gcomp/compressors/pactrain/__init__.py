"""The pactrain family: ``pactrain`` (PacTrain, Wang, Wu, Li, Kutscher 2025), the all-reduce of only the entries a
pruned model keeps, packed densely, ternary on top if asked. Prune first (``gcomp.pruning.prune``), build DDP (or
``fully_shard``), install this. ``prunex`` runs it between node leaders (``gcomp.compressors.prunex``).

- ``codec``: ``PacTrainCompressor``, the payload of each mode, the ternary lanes and their carried scale;
- ``tracker``: ``MaskTracker``, when a layout's support is stable and agreed on, so that it may travel packed;
- ``support``: the supports themselves, built from the masks (DDP's buckets, FSDP2's rows).
"""
from __future__ import annotations

import warnings
from typing import Annotated

import torch

from gcomp.collectives.reduce import ChainedAllreduceCommunicator
from gcomp.compressors.pactrain.codec import PacTrainCompressor
from gcomp.compressors.pactrain.tracker import ENTRIES, GROUPS, MaskTracker
from gcomp.core import NoMemory
from gcomp.method import Method
from gcomp.params import Range
from gcomp.registry import register

__all__ = ["ENTRIES", "GROUPS", "ROUNDS_HELP", "MaskTracker", "PacTrainCompressor", "PacTrainMethod",
           "warn_unused_ternary_options"]


class PacTrainMethod(Method):
    """A ``PacTrainCompressor``'s method: its tracker watches DDP's buffer broadcasts (``watch``) and agrees on the
    masks every rank holds at install (``install_flags``, one MAX all-reduce the state runs). Under FSDP2 it packs
    single entries only."""

    def watch(self, ddp) -> None:
        self.compressor.tracker.watch(ddp)

    def install_flags(self):
        return self.compressor.tracker.install_flags()

    def receive_install_flags(self, flags) -> None:
        self.compressor.tracker.receive_install_flags(flags)

    @property
    def serves_fsdp(self) -> bool:
        return super().serves_fsdp and self.compressor.tracker.granularity == ENTRIES

    def flush(self, bucket, like):
        """What the ternary path carries for ``bucket`` (its error feedback, or the excess a carried scale clipped),
        laid out in the bucket (or FSDP2's whole input, ``bucket`` its pieces) at its kept positions, removed: ``auto``
        hands it to the next method."""
        for key, track in self.compressor.tracker.tracks.items():
            rows = getattr(track.support, "layout", None)  # FSDP2's ShardSupport, keyed by its parameters
            if key == bucket.key or (rows is not None and rows.pieces.key == bucket.key):
                break
        else:
            return None
        if track.carry.residual is None:
            return None
        face = track.support if rows is None else track.support.ternary
        out = torch.zeros(bucket.numel, dtype=like.dtype, device=like.device)
        out.index_put_((face.positions.long(),), track.carry.residual.to(like.dtype), accumulate=True)
        track.carry.residual = None
        return out

ROUNDS_HELP = ("ternary: 1, one all-reduce with the scale carried from the step before (a value above it is "
               "clipped and its excess carried to the rank's next step); 2, the exact shared scale first, unbiased "
               "at every step")
VARIANTS = ({"ternary": True}, {"ternary": True, "rounds": 2}, {"ternary": True, "error_feedback": True})


@register("pactrain", paper="Wang, Wu, Li, Kutscher 2025 (PacTrain, arXiv 2505.18563)", variants=VARIANTS)
def pactrain(
    ternary: Annotated[bool, "ternarise the packed entries (shared per-parameter scale, integer lanes)"] = False,
    stable_steps: Annotated[int, Range(1, None), "steps a bucket's masks must stay unchanged before packing "
                                             "(masks changed after install; those of install pack after one step)"] = 5,
    dense_above: Annotated[float, Range(0, 1), "keep a bucket dense when its support keeps more than this"] = 0.9,
    clip: Annotated[float, Range(0, None), "ternary: clip at clip * std per parameter (TernGrad: 2.5; 0 off)"] = 0.0,
    error_feedback: Annotated[bool, "ternary: add what ternarising lost to the next step"] = False,
    seed: Annotated[int, Range(0, None), "seed of the ternary draws (each rank draws its own stream from it)"] = 0,
    check_every: Annotated[int, Range(0, None), "compare a packed bucket's masks with those it froze on every this "
                                                "many steps (edits through .data; 0: never)"] = 10,
    rounds: Annotated[int, Range(1, 2), ROUNDS_HELP] = 1,
) -> Method:
    """PacTrain: only the entries the pruning masks keep are all-reduced, packed densely, once stable."""
    warn_unused_ternary_options("pactrain", ternary, clip=clip > 0, error_feedback=error_feedback, rounds=rounds != 1)
    return PacTrainMethod(PacTrainCompressor(stable_steps, dense_above, ternary, clip, error_feedback, seed,
                                             check_every=check_every, rounds=rounds), NoMemory(),
                          ChainedAllreduceCommunicator())


def warn_unused_ternary_options(method: str, ternary: bool, **set_options: bool) -> None:
    """Warn that the ternary options set (``set_options[name]`` true) do nothing without ``ternary``."""
    idle = [name for name, on in set_options.items() if on]
    if idle and not ternary:
        warnings.warn(f"{method}: parameter {' and '.join(map(repr, idle))} has no effect without ternary=True",
                      UserWarning, stacklevel=4)
