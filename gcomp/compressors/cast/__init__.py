"""The cast family: ``identity`` (the bucket as it is: the baseline), ``fp16`` and ``bf16`` (cast to 16 bits), each
summed by all-reduce in its wire dtype."""
from __future__ import annotations

import torch

from gcomp.collectives import AllreduceCommunicator
from gcomp.core import EXACT, Compressor, NoMemory, Payload, Traits, relative
from gcomp.method import Method
from gcomp.registry import register

UNIT_ROUNDOFF = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}


class CastCompressor(Compressor):
    """Sends the bucket cast to ``dtype`` (None: in its own dtype, 32 bits an entry for fp32; fp16 and bf16: 16) by
    SUM all-reduce in that dtype, and casts the sum back. gloo sums fp16 and bf16 on the CPU too. The hook divided
    by the world size first, so the low-precision sum is the mean and does not overflow where the fp32 mean would
    not. Entry for entry: under FSDP2 the same payload, reduce-scattered row by row."""

    def __init__(self, dtype: torch.dtype | None = None):
        self.dtype = dtype
        self.traits = Traits(fidelity=EXACT if dtype is None else relative(UNIT_ROUNDOFF[dtype]), rows="whole",
                             wire_bytes=lambda bucket, world: bucket.numel * (dtype or bucket.dtype).itemsize)

    def encode(self, x, state, layout):
        return Payload([x if self.dtype is None else x.to(self.dtype)], ctx=x.dtype), state

    def decode(self, received, ctx):
        return received[0].to(ctx)


@register("identity")
def identity() -> Method:
    """Plain all-reduce of the whole bucket, bit-identical to DDP without a hook: the baseline."""
    return Method(CastCompressor(), NoMemory(), AllreduceCommunicator())


@register("fp16")
def fp16() -> Method:
    """Cast to float16, all-reduce in float16, cast back: half the bytes, about 3 significant digits."""
    return Method(CastCompressor(torch.float16), NoMemory(), AllreduceCommunicator())


@register("bf16")
def bf16() -> Method:
    """Cast to bfloat16, all-reduce in bfloat16, cast back: half the bytes, fp32's range, 2-3 digits."""
    return Method(CastCompressor(torch.bfloat16), NoMemory(), AllreduceCommunicator())
