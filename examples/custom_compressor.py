"""Add a compression method to gcomp: a codec, a registered factory, and it is usable by name. Two here:
``scaled-sign`` (docs/add-a-method.md's example, as it is there) and ``absmax`` (int8 codes, with a parameter).

    python examples/custom_compressor.py            # describe absmax, then train with it on 2 workers
    python examples/custom_compressor.py --nproc 2 --compressor identity,absmax,scaled-sign --param absmax.bits=4

Any flags are passed on to examples/train.py; without flags it compares identity and absmax on 2 workers.
"""
from typing import Annotated

import torch

import gcomp
from gcomp.collectives import AllgatherCommunicator


class ScaledSign(gcomp.Compressor):
    """One sign per entry (a bool) and the bucket's mean |x| (fp32), by all-gather."""

    traits = gcomp.Traits(gcomp.ALLGATHER, gcomp.contraction(), wire_bytes=lambda bucket, world: bucket.numel + 4)

    def encode(self, x, state, layout):
        return gcomp.Payload([x >= 0, x.abs().mean(dtype=torch.float32).reshape(1)], ctx=x.dtype), state

    def decode(self, received, ctx):
        signs, scales = received  # every rank's, stacked: (world, n) and (world, 1)
        return torch.where(signs, scales, -scales).sum(0).to(ctx)


@gcomp.register("scaled-sign")
def scaled_sign() -> gcomp.Method:
    """Signs and one scale per bucket, with error feedback, by all-gather."""
    return gcomp.Method(ScaledSign(), gcomp.ResidualMemory(), AllgatherCommunicator())


class AbsmaxCompressor(gcomp.Compressor):
    """Each entry rounded to ``bits`` bits (int8 codes) of one fp32 scale per rank, ``max |x|``, by all-gather:
    every rank has its own scale, so each rank decodes every rank's payload. Rounding: half a level of the scale."""

    def __init__(self, bits: int):
        self.levels = 2 ** (bits - 1) - 1  # symmetric: -levels .. levels
        self.traits = gcomp.Traits(gcomp.ALLGATHER, gcomp.relative(0.5 / self.levels, block=0),
                                   wire_bytes=lambda bucket, world: bucket.numel + 4)

    def encode(self, x, state, layout):
        scale = x.abs().max().float().clamp_min(1e-30).reshape(1)  # NaN stays NaN, so it reaches everyone
        return gcomp.Payload([torch.round(x / scale * self.levels).to(torch.int8), scale], ctx=x.dtype), state

    def decode(self, received, ctx):
        codes, scales = received  # every rank's: (world, n) and (world, 1)
        return (codes.float() * (scales / self.levels)).sum(0).to(ctx)


@gcomp.register("absmax")
def absmax(bits: Annotated[int, gcomp.Range(2, 8), "bits per entry"] = 8) -> gcomp.Method:
    """Absmax quantisation with error feedback: int8 codes and one scale per rank, by all-gather."""
    return gcomp.Method(AbsmaxCompressor(bits), gcomp.ResidualMemory(), AllgatherCommunicator())


if __name__ == "__main__":
    import sys

    from train import main  # examples/train.py, next to this file

    print(gcomp.describe("absmax"), end="\n\n")
    main(sys.argv[1:] or ["--nproc", "2", "--compressor", "identity,absmax", "--epochs", "3"])
