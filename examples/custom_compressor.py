"""Add a compression method to gcomp: a codec, a registered factory, and it is usable by name.

    python examples/custom_compressor.py            # describe it, then train with it on 2 workers
    python examples/custom_compressor.py --nproc 2 --compressor identity,absmax --param absmax.bits=4

Any flags are passed on to examples/train.py; without flags it compares identity and absmax on 2 workers.
"""
from typing import Annotated

import torch

import gcomp
from gcomp import ALLGATHER, Compressor, Method, Payload, Range, ResidualMemory
from gcomp.collectives import AllgatherCommunicator


class AbsmaxCompressor(Compressor):
    """Sends each entry rounded to ``bits`` bits (as int8) plus one float32 scale, ``max |x|``, by all-gather.

    Every rank has its own scale, so payloads cannot be summed on the wire: each rank decodes the others'.
    """

    collective = ALLGATHER

    def __init__(self, bits: int):
        self.levels = 2 ** (bits - 1) - 1  # symmetric: -levels .. levels

    def compress(self, tensor, bucket):
        scale = tensor.abs().max().clamp_min(1e-30).reshape(1).float()  # NaN stays NaN, so it reaches everyone
        codes = torch.round(tensor / scale * self.levels).to(torch.int8)
        return Payload([codes, scale], ctx=tensor.dtype)

    def decompress(self, tensors, ctx):
        codes, scale = tensors
        return (codes.float() * (scale / self.levels)).to(ctx)

    def aggregate(self, gathered, ctx):
        codes, scales = gathered  # every rank's payload stacked: (world, n) and (world, 1)
        return (codes.float() * (scales / self.levels)).sum(0).to(ctx)


@gcomp.register("absmax")
def absmax(bits: Annotated[int, Range(2, 8), "bits per entry"] = 8) -> Method:
    """Absmax quantisation with error feedback: int8 codes and one scale per rank, by all-gather."""
    return Method(AbsmaxCompressor(bits), ResidualMemory(), AllgatherCommunicator())


if __name__ == "__main__":
    import sys

    from train import main  # examples/train.py, next to this file

    print(gcomp.describe("absmax"), end="\n\n")
    main(sys.argv[1:] or ["--nproc", "2", "--compressor", "identity,absmax", "--epochs", "3"])
