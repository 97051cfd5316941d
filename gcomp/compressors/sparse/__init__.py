"""The sparse family: chosen entries of each bucket as values and positions (``gcomp.collectives.sparse_wire``):
``topk``, ``threshold`` and ``dgc`` by all-gather, ``randomk`` (shared positions, values alone) by all-reduce, ``gtopk``
by point-to-point messages."""
from __future__ import annotations

from typing import Annotated

from gcomp.collectives import AllgatherCommunicator, AllreduceCommunicator
from gcomp.collectives.program import ProgramCommunicator
from gcomp.collectives.sized import SizedAllgatherCommunicator
from gcomp.collectives.sparse_wire import PositionsParam, ValuesParam
from gcomp.compressors.sparse.dgc import DGCCompressor
from gcomp.compressors.sparse.gtopk import GlobalTopKCompressor
from gcomp.compressors.sparse.randomk import RandomKCompressor
from gcomp.compressors.sparse.threshold import ThresholdCompressor
from gcomp.compressors.sparse.topk import TopKCompressor
from gcomp.core import NoMemory, ResidualMemory
from gcomp.method import Method
from gcomp.params import Range
from gcomp.registry import register

Fraction = Annotated[float, Range(0, 1, low_open=True), "fraction of the bucket's entries sent"]


@register("topk", paper="Aji & Heafield 2017 (gradient dropping); Stich et al. 2018 (error feedback)")
def topk(ratio: Fraction = 0.01, positions: PositionsParam = "coded", values: ValuesParam = "fp32") -> Method:
    """Top-k sparsification with error feedback: the largest entries go by all-gather, the rest wait."""
    return Method(TopKCompressor(ratio, positions, values), ResidualMemory(), AllgatherCommunicator())


@register("threshold", paper="Strom 2015 (Scalable distributed DNN training using commodity GPU cloud computing)")
def threshold(threshold: Annotated[float, Range(0, None), "send entries of the local gradient with |g| above this"]
              = 0.01, positions: PositionsParam = "coded", values: ValuesParam = "fp32") -> Method:
    """Threshold sparsification with error feedback: a variable count per rank, sizes exchanged, then all-gather."""
    return Method(ThresholdCompressor(threshold, positions, values), ResidualMemory(), SizedAllgatherCommunicator())


@register("dgc", paper="Lin, Han, Mao, Wang, Dally, ICLR 2018 (Deep Gradient Compression)")
def dgc(
    ratio: Annotated[float, Range(0, 1, low_open=True), "density after warm-up: fraction of each bucket sent"] = 0.001,
    momentum: Annotated[float, Range(0, 1, high_open=True), "momentum of the correction (use SGD without momentum)"]
    = 0.9,
    nesterov: Annotated[bool, "Nesterov momentum correction"] = False,
    masking: Annotated[bool, "momentum-factor masking: clear the momentum of sent entries"] = True,
    clip_norm: Annotated[float, Range(0, None), "local clipping: max norm per parameter of the summed gradient, "
                                                "each rank clips at clip_norm / sqrt(world) (0: off)"] = 0.0,
    warmup_steps: Annotated[int, Range(0, None), "compressing steps of density warm-up (0: none)"] = 0,
    warmup_stages: Annotated[int, Range(1, None), "warm-up stages, density falling exponentially to ratio"] = 4,
    sample_ratio: Annotated[float, Range(0, 1, low_open=True), "fraction of |v| sampled for the threshold"] = 0.01,
    seed: Annotated[int, Range(0, None), "seed of the sample offsets (each rank draws its own stream from it)"] = 0,
    positions: PositionsParam = "coded",
    values: ValuesParam = "fp32",
) -> Method:
    """Deep Gradient Compression: momentum-corrected top-k by sampled threshold, masking, warm-up, all-gather."""
    return Method(DGCCompressor(ratio, momentum, nesterov, masking, clip_norm, warmup_steps, warmup_stages,
                                sample_ratio, seed, positions, values), NoMemory(), AllgatherCommunicator())


@register("randomk", paper="Stich, Cordonnier, Jaggi 2018 (Sparsified SGD with memory: random-k)")
def randomk(ratio: Fraction = 0.01,
            seed: Annotated[int, Range(0, None), "seed of the positions, the same on every rank"] = 0) -> Method:
    """Random-k sparsification with error feedback: shared random positions, values alone by all-reduce."""
    return Method(RandomKCompressor(ratio, seed), ResidualMemory(), AllreduceCommunicator())


@register("gtopk", paper="Shi et al., A Distributed Synchronous SGD Algorithm with Global Top-k Sparsification, "
                         "ICDCS 2019")
def gtopk(density: Fraction = 0.01, positions: PositionsParam = "coded", values: ValuesParam = "fp32") -> Method:
    """Global top-k: pairwise tree merge with re-selection, then a tree broadcast; point-to-point messages."""
    return Method(GlobalTopKCompressor(density, positions, values), NoMemory(), ProgramCommunicator())
