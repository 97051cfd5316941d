"""The sign family: ``signsgd``, ``signum`` and ``efsignsgd``, 1 bit per element plus one fp32 scale, by all-gather.

Sign bits: an entry ``x >= 0`` (``+0.0`` and ``-0.0`` included) is sent as bit 1 and decodes to ``+1``; ``x < 0``
is bit 0 and decodes to ``-1``; a NaN compares false and goes as bit 0. One bit cannot carry a zero or a NaN, so
every rank also sends the scale ``mean(|x|)`` of what it signed (fp32): it is NaN or infinite as soon as one entry
is, and every rank multiplies by every rank's scale, so a non-finite gradient anywhere surfaces everywhere.

Scaling (why the update is a mean gradient): the hook divides each bucket by the world size N before
compressing, so rank r's scale ``a_r = mean|g_r| / N`` and the decoded payload ``a_r * sign(g_r)`` has the size of
rank r's share of the mean gradient. Two aggregations, the same on every rank:

- ``majority`` (the default of ``signsgd`` and ``signum``; Bernstein et al. 2018, signSGD with majority vote):
  ``(sum_r a_r) * sign(sum_r sign(g_r))``, ties (an even split) giving 0. The vote is not a sum of per-rank
  decodes (``decodes_alone`` is false), so the contract suite leaves its value to this module's tests;
- ``mean``: ``sum_r a_r * sign(g_r)``, the sum of the decoded payloads (the mean over ranks of what they sent).
"""
from __future__ import annotations

from typing import Annotated

import torch

from gcomp.bucket_state import BucketState, KeptInBucketState
from gcomp.collectives import AllgatherCommunicator, bitpack
from gcomp.core import ALLGATHER, Compressor, Method, Payload
from gcomp.memory import NoMemory, ResidualMemory
from gcomp.params import OneOf, Range
from gcomp.registry import register

AGGREGATES = ("mean", "majority")


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """One bit per entry (1 for ``x >= 0``, 0 for ``x < 0`` and NaN) in ``ceil(n / 64)`` int64 words."""
    return bitpack.pack((x >= 0).reshape(-1), 1)


def unpack_signs(words: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` sign bits of the flat ``words`` (uint8, 0 or 1)."""
    return bitpack.unpack(words.reshape(-1), n, 1, dtype=torch.uint8)


def _plus_minus(bits: torch.Tensor) -> torch.Tensor:
    """Bits 0/1 as -1.0/+1.0 (fp32)."""
    return bits.to(torch.float32).mul_(2).sub_(1)


class ScaledSignCompressor(Compressor):
    """Sends ``sign(x)`` as 1 bit per entry (int64 words, ``ceil(n / 64) * 8`` bytes) plus ``mean(|x|)`` as one
    fp32 number, by all-gather; decodes to ``mean(|x|) * sign(x)``. ``aggregate`` is ``mean`` (the sum of the
    decoded payloads) or ``majority`` (the summed scales times the sign of the vote, ties 0): see the module doc.
    """

    collective = ALLGATHER

    def __init__(self, aggregate: str = "mean"):
        if aggregate not in AGGREGATES:
            raise ValueError(f"aggregate must be one of {AGGREGATES}; got {aggregate!r}")
        self.aggregate_by = aggregate
        self.decodes_alone = aggregate == "mean"

    def _encode(self, x: torch.Tensor, dtype: torch.dtype) -> Payload:
        # Summed in float64, so the fp32 scale does not depend on where DDP put each parameter in the bucket
        # (a resumed run starts on DDP's first layout and must follow the run that never stopped bit for bit).
        scale = x.abs().sum(dtype=torch.float64).div_(x.numel()).to(torch.float32).reshape(1)
        return Payload([pack_signs(x), scale], ctx=(x.numel(), dtype))

    def compress(self, tensor, bucket):
        return self._encode(tensor, tensor.dtype)

    def decompress(self, tensors, ctx):
        words, scale = tensors
        n, dtype = ctx
        return _plus_minus(unpack_signs(words, n)).mul_(scale.reshape(())).to(dtype)

    def aggregate(self, gathered, ctx):
        words, scales = gathered  # (world, n_words) int64, (world, 1) fp32
        n, dtype = ctx
        world = words.shape[0]
        bits = unpack_signs(words, words.numel() * 64).view(world, -1)[:, :n]
        if self.aggregate_by == "majority":
            vote = bits.sum(0, dtype=torch.int32).mul_(2).sub_(world).sign_()  # (#plus - #minus), ties 0
            return vote.to(torch.float32).mul_(scales.sum()).to(dtype)
        return (scales.reshape(1, world) @ _plus_minus(bits)).reshape(n).to(dtype)


class SignumCompressor(KeptInBucketState, ScaledSignCompressor):
    """Signum: keeps ``m = momentum * m + (1 - momentum) * g`` per bucket (fp32, per parameter in checkpoints)
    and sends ``sign(m)`` as 1 bit per entry plus ``mean(|m|)`` as one fp32 number, by all-gather.

    Non-finite momentum entries are reset to zero after being sent, so one overflowing step (which AMP skips)
    does not poison the later ones.
    """

    stateful = True

    def __init__(self, momentum: float, aggregate: str = "mean"):
        super().__init__(aggregate)
        self.momentum = momentum
        self._state = BucketState(("momentum",), owner="SignumCompressor")

    def compress(self, tensor, bucket):
        g = tensor.to(torch.float32)
        old = self._state.find(bucket, g)
        m = (g * (1.0 - self.momentum) if old is None
             else old["momentum"].mul(self.momentum).add_(g, alpha=1.0 - self.momentum))
        payload = self._encode(m, tensor.dtype)
        self._state.put(bucket, {"momentum": torch.nan_to_num(m, nan=0.0, posinf=0.0, neginf=0.0)})
        return payload



_AGGREGATE_HELP = "how ranks' signs combine: 'mean' of the scaled signs, or 'majority' vote (ties 0)"


@register("signsgd", paper="Bernstein et al. 2018, signSGD: compressed optimisation for non-convex problems "
                           "(majority vote: signSGD with majority vote is communication efficient and fault tolerant)")
def signsgd(aggregate: Annotated[str, OneOf(*AGGREGATES), _AGGREGATE_HELP] = "majority") -> Method:
    """signSGD: 1 bit per entry plus one fp32 scale per rank by all-gather; mean of scaled signs or majority vote."""
    return Method(ScaledSignCompressor(aggregate), NoMemory(), AllgatherCommunicator())


@register("signum", paper="Bernstein et al. 2018, signSGD (Signum: sign of the momentum)")
def signum(momentum: Annotated[float, Range(0, 1, high_open=True), "momentum of the signed running average"] = 0.9,
           aggregate: Annotated[str, OneOf(*AGGREGATES), _AGGREGATE_HELP] = "majority") -> Method:
    """Signum: the sign of a per-bucket momentum, 1 bit per entry plus one fp32 scale per rank by all-gather."""
    return Method(SignumCompressor(momentum, aggregate), NoMemory(), AllgatherCommunicator())


@register("efsignsgd", paper="Karimireddy et al. 2019, Error feedback fixes SignSGD and other gradient "
                             "compression schemes")
def efsignsgd() -> Method:
    """EF-signSGD: the scaled sign mean(|v|) * sign(v) of the compensated gradient, with error feedback."""
    return Method(ScaledSignCompressor("mean"), ResidualMemory(), AllgatherCommunicator())
