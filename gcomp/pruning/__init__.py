"""Pruning for PacTrain: one-shot masks (GraSP, magnitude, random) installed through ``torch.nn.utils.prune``.

    from gcomp.pruning import prune
    result = prune(model, 0.5, "grasp", data=(inputs, targets))   # before wrapping the model in DDP
"""
from gcomp.pruning.masks import mask_of, masks_digest, named_masks, positions_digest
from gcomp.pruning.prune import PruneResult, kept_fraction, prune

__all__ = ["PruneResult", "kept_fraction", "mask_of", "masks_digest", "named_masks", "positions_digest", "prune"]
