"""Pruning through ``torch.nn.utils.prune``: one-shot masks for PacTrain, structured ADMM for PruneX.

    from gcomp.pruning import prune, StructuredADMM
    result = prune(model, 0.5, "grasp", data=(inputs, targets))   # before wrapping the model in DDP
    admm = StructuredADMM(model, sparsity=0.6)                    # during training; admm.prune() at the end
"""
from gcomp.pruning.admm import StructuredADMM
from gcomp.pruning.masks import (check_masks_agree, mask_of, masks_digest, named_masks, no_buffer_sync,
                                 positions_digest)
from gcomp.pruning.prune import PruneResult, kept_fraction, prune

__all__ = ["PruneResult", "StructuredADMM", "check_masks_agree", "kept_fraction", "mask_of", "masks_digest",
           "named_masks", "no_buffer_sync", "positions_digest", "prune"]

