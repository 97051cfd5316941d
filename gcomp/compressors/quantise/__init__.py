"""The stochastic quantisers: ``qsgd`` (levels of each parameter's norm), ``terngrad`` (ternary codes, gathered or
summed in integer lanes) and ``natural`` (powers of two), each unbiased, drawn from a random stream per rank."""
from __future__ import annotations

from typing import Annotated

from gcomp.collectives import AllgatherCommunicator, ChainedAllreduceCommunicator
from gcomp.compressors.quantise.norm_levels import MAX_LEVELS, QSGDCompressor, field_bits
from gcomp.compressors.quantise.powers_of_two import NaturalCompressor
from gcomp.compressors.quantise.ternary import SharedScaleTernGradCompressor, TernGradCompressor
from gcomp.core import ALLGATHER, ALLREDUCE, NoMemory
from gcomp.method import Method
from gcomp.params import OneOf, Range
from gcomp.registry import register

__all__ = ["MAX_LEVELS", "NaturalCompressor", "QSGDCompressor", "SharedScaleTernGradCompressor",
           "TernGradCompressor", "field_bits"]

SEED = "seed of the draws (each rank draws its own stream from it)"


@register("qsgd", paper="Alistarh, Grubic, Li, Tomioka, Vojnovic 2017 (QSGD, NeurIPS)",
          variants=({"levels": 1}, {"levels": 3}))
def qsgd(
    levels: Annotated[int, Range(1, MAX_LEVELS), "quantisation levels s per sign (bits per entry: log2(2s+1) up)"
                      ] = 127,
    seed: Annotated[int, Range(0, None), SEED] = 0,
) -> Method:
    """QSGD: entries rounded at random onto s levels of their parameter's L2 norm (unbiased), by all-gather."""
    return Method(QSGDCompressor(levels, seed), NoMemory(), AllgatherCommunicator())


@register("terngrad", paper="Wen et al. 2017 (TernGrad, NeurIPS)", variants=({"collective": ALLREDUCE},))
def terngrad(
    clip: Annotated[float, Range(0, None), "clip at clip * std per parameter (TernGrad: 2.5; 0 off, unbiased)"] = 2.5,
    collective: Annotated[str, OneOf(ALLGATHER, ALLREDUCE),
                          "allgather: 2-bit codes and own scales; allreduce: shared MAX scale, integer lanes"
                          ] = ALLGATHER,
    seed: Annotated[int, Range(0, None), SEED] = 0,
) -> Method:
    """TernGrad: each entry becomes -s, 0 or +s at random, s one scale per parameter (unbiased unless clipped)."""
    if collective == ALLREDUCE:
        return Method(SharedScaleTernGradCompressor(clip, seed), NoMemory(), ChainedAllreduceCommunicator())
    return Method(TernGradCompressor(clip, seed), NoMemory(), AllgatherCommunicator())


@register("natural", paper="Horváth, Ho, Horváth, Sahu, Canini, Richtárik 2019 (natural compression)")
def natural(seed: Annotated[int, Range(0, None), SEED] = 0) -> Method:
    """Natural compression: entries rounded at random to a power of two (unbiased), 9 bits each, all-gather."""
    return Method(NaturalCompressor(seed), NoMemory(), AllgatherCommunicator())
