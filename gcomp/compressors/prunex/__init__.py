"""The prunex family: ``prunex``, PruneX's communication (Olama et al., 2025): hierarchical, with the inter-node stage
compacted to the filters and channels a structurally pruned model keeps. Prune with ``gcomp.pruning.StructuredADMM``."""
from __future__ import annotations

from typing import Annotated

from gcomp.collectives.reduce import ChainedAllreduceCommunicator
from gcomp.compressors.composites import HierarchicalMethod
from gcomp.compressors.pactrain import (GROUPS, ROUNDS_HELP, PacTrainCompressor, PacTrainMethod,
                                        warn_unused_ternary_options)
from gcomp.core import NoMemory
from gcomp.params import Range
from gcomp.registry import register


class PruneXMethod(HierarchicalMethod):
    """The bucket inside the node; between leaders only its kept filters and channels (SUM, no index); broadcast.

    ``hierarchical`` whose inner method is pactrain's mask-packed all-reduce over whole filters and channels. On the
    wire, per bucket: a SUM all-reduce of the whole bucket inside the node; on each leader, across the leaders'
    group, while the tracker checks the masks: the bucket and 5 int64 flags (MAX); once compacted: a SUM all-reduce
    of the kept filters and channels in the bucket's dtype plus one entry flagging mask changes (with ``ternary``:
    pactrain's lanes, in one round with the scale carried from the step before); then a broadcast inside the node.
    """

    def __init__(self, inner: PacTrainMethod, ranks_per_node: int):
        super().__init__(inner, ranks_per_node, label="prunex")


@register("prunex", paper="Olama, Lundell, El Hajj, Lilius, Bjorkqvist 2025 (PruneX, arXiv 2512.14628)")
def prunex(
    ranks_per_node: Annotated[int, Range(0, None), "ranks per node; 0: from torchrun or host names"] = 0,
    ternary: Annotated[bool, "ternarise the compacted inter-node payload (as pactrain's ternary)"] = False,
    stable_steps: Annotated[int, Range(1, None), "steps a bucket's masks must stay unchanged before compacting "
                                             "(masks changed after install; those of install: one step)"] = 5,
    dense_above: Annotated[float, Range(0, 1), "send a bucket uncompacted when it keeps more than this"] = 1.0,
    check_every: Annotated[int, Range(0, None), "compare a compacted bucket's masks with those it froze on every "
                                                "this many steps (edits through .data; 0: never)"] = 10,
    clip: Annotated[float, Range(0, None), "ternary: clip at clip * std per parameter (TernGrad: 2.5; 0 off)"] = 0.0,
    error_feedback: Annotated[bool, "ternary: add what ternarising lost to the next step (on each leader)"] = False,
    seed: Annotated[int, Range(0, None), "seed of the ternary draws (each leader draws its own stream from it)"] = 0,
    rounds: Annotated[int, Range(1, 2), ROUNDS_HELP] = 1,
) -> PruneXMethod:
    """Dense SUM inside each node; between node leaders only, a dense all-reduce of the kept filters and
    channels, copied out of the bucket as blocks (no index on the wire); broadcast in each node.

    The default ``dense_above=1.0`` compacts every bucket, the unpruned ones too (a copy, plus one entry
    that flags mask changes): so masks installed after ``gcomp.install`` (ADMM's hard prune, mid-training)
    are noticed on every leader alike, and the compacted layout is rebuilt. ``clip``, ``error_feedback``,
    ``seed`` and ``rounds`` are pactrain's ternary options, for ``ternary=True``."""
    warn_unused_ternary_options("prunex", ternary, clip=clip > 0, error_feedback=error_feedback, seed=seed != 0,
                                rounds=rounds != 1)
    packer = PacTrainCompressor(stable_steps, dense_above, ternary, clip, error_feedback, seed, granularity=GROUPS,
                                check_every=check_every, rounds=rounds)
    packer.tracker.label = "prunex"
    inner = PacTrainMethod(packer, NoMemory(), ChainedAllreduceCommunicator(), name="pactrain")
    return PruneXMethod(inner, ranks_per_node)
