"""``fp16`` and ``bf16``: cast, all-reduce in low precision, cast back."""
from __future__ import annotations

import torch

from gcomp.collectives import AllreduceCommunicator
from gcomp.core import ALLREDUCE, Compressor, Method, Payload
from gcomp.memory import NoMemory
from gcomp.registry import register


class CastCompressor(Compressor):
    """Sends the bucket cast to a 16-bit float dtype (16 bits per element) by SUM all-reduce in that dtype.

    Works on CPU with gloo too (gloo sums fp16 and bf16), unlike PyTorch's own ``bf16_compress_hook``.
    The hook has already divided by the world size, so the low-precision sum is the mean and does not
    overflow where the fp32 mean would not.
    """

    collective = ALLREDUCE

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def compress(self, tensor, bucket):
        return Payload([tensor.to(self.dtype)], ctx=tensor.dtype)

    def decompress(self, tensors, ctx):
        return tensors[0].to(ctx)


@register("fp16")
def fp16() -> Method:
    """Cast to float16, all-reduce in float16, cast back: half the bytes, about 3 significant digits."""
    return Method(CastCompressor(torch.float16), NoMemory(), AllreduceCommunicator())


@register("bf16")
def bf16() -> Method:
    """Cast to bfloat16, all-reduce in bfloat16, cast back: half the bytes, fp32's range, 2-3 digits."""
    return Method(CastCompressor(torch.bfloat16), NoMemory(), AllreduceCommunicator())
