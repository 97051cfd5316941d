"""The sign family: ``signsgd``, ``signum`` and ``efsignsgd`` (a scaled sign: 1 bit per entry plus one fp32 scale)
and ``onebit`` (1 bit per entry plus two fp32 means per parameter), by all-gather.

Sign bits: an entry ``x >= 0`` (``+0.0`` and ``-0.0`` included) is bit 1, ``x < 0`` and NaN bit 0. One bit cannot
carry a zero or a NaN, so the scale (or the mean of the side) is sent beside it: it is NaN or infinite as soon as
one entry is, and every rank decodes every rank's payload, so a non-finite gradient anywhere surfaces everywhere.

The hook divides each bucket by the world size N first, so rank r's scale is ``a_r = mean|g_r| / N`` and its
decoded payload ``a_r * sign(g_r)`` its share of the mean gradient. Two aggregations, the same on every rank:
``majority`` (the default of ``signsgd`` and ``signum``; Bernstein et al. 2018, signSGD with majority vote),
``(sum_r a_r) * sign(sum_r sign(g_r))`` with ties (an even split) 0, which is not a sum of decodes; and ``mean``,
``sum_r a_r * sign(g_r)``.
"""
from __future__ import annotations

from typing import Annotated

from gcomp.collectives import AllgatherCommunicator
from gcomp.compressors.sign.onebit import OneBitCompressor
from gcomp.compressors.sign.scaled import AGGREGATES, ScaledSignCompressor, SignumCompressor
from gcomp.core import NoMemory, ResidualMemory
from gcomp.method import Method
from gcomp.params import OneOf, Range
from gcomp.registry import register

_AGGREGATE_HELP = "how ranks' signs combine: 'mean' of the scaled signs, or 'majority' vote (ties 0)"
_MEAN = ({"aggregate": "mean"},)


@register("signsgd", paper="Bernstein et al. 2018, signSGD: compressed optimisation for non-convex problems "
                           "(majority vote: signSGD with majority vote is communication efficient and fault tolerant)",
          variants=_MEAN)
def signsgd(aggregate: Annotated[str, OneOf(*AGGREGATES), _AGGREGATE_HELP] = "majority") -> Method:
    """signSGD: 1 bit per entry plus one fp32 scale per rank by all-gather; mean of scaled signs or majority vote."""
    return Method(ScaledSignCompressor(aggregate), NoMemory(), AllgatherCommunicator())


@register("signum", paper="Bernstein et al. 2018, signSGD (Signum: sign of the momentum)", variants=_MEAN)
def signum(momentum: Annotated[float, Range(0, 1, high_open=True), "momentum of the signed running average"] = 0.9,
           aggregate: Annotated[str, OneOf(*AGGREGATES), _AGGREGATE_HELP] = "majority") -> Method:
    """Signum: the sign of a per-bucket momentum, 1 bit per entry plus one fp32 scale per rank by all-gather."""
    return Method(SignumCompressor(momentum, aggregate), NoMemory(), AllgatherCommunicator())


@register("efsignsgd", paper="Karimireddy et al. 2019, Error feedback fixes SignSGD and other gradient "
                             "compression schemes")
def efsignsgd() -> Method:
    """EF-signSGD: the scaled sign mean(|v|) * sign(v) of the compensated gradient, with error feedback."""
    return Method(ScaledSignCompressor("mean"), ResidualMemory(), AllgatherCommunicator())


@register("onebit", paper="Seide et al. 2014, 1-bit stochastic gradient descent and its application to "
                          "data-parallel distributed training of speech DNNs")
def onebit() -> Method:
    """1-bit SGD: one bit per entry, decoded to the mean of its side (per parameter), with error feedback."""
    return Method(OneBitCompressor(), ResidualMemory(), AllgatherCommunicator())
