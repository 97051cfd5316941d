"""``fp16`` and ``bf16``: cast, all-reduce in low precision, cast back."""
from __future__ import annotations

import torch

from gcomp.collectives import AllreduceCommunicator
from gcomp.core import ALLREDUCE, Compressor, Payload
from gcomp.memory import NoMemory
from gcomp.method import Method
from gcomp.registry import register
from gcomp.sharding import EntrywiseRows


class CastCompressor(Compressor):
    """Sends the bucket cast to a 16-bit float dtype (16 bits per element) by SUM all-reduce in that dtype.

    Works on CPU with gloo too (gloo sums fp16 and bf16), unlike PyTorch's own ``bf16_compress_hook``.
    The hook has already divided by the world size, so the low-precision sum is the mean and does not
    overflow where the fp32 mean would not.


    Memory: one 16-bit buffer per bucket layout, allocated at its first step and cast into at every step,
    and the result cast back into the bucket it came from. Casting into tensors that exist costs about one
    copy each way on a CPU; a fresh allocation of a bucket's size costs several (its pages are faulted in
    anew), which is what ``tensor.to(dtype)`` did at every step.
    """

    collective = ALLREDUCE

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self._wire: dict[str, torch.Tensor] = {}  # bucket layout -> its 16-bit buffer (scratch, not state)

    def compress(self, tensor, bucket):
        if tensor.dtype == self.dtype:  # a bucket already in the wire's dtype goes as it is
            return Payload([tensor], ctx=None)
        wire = self._wire.get(bucket.key)
        if wire is None or wire.numel() != tensor.numel() or wire.device != tensor.device:
            wire = self._wire[bucket.key] = torch.empty(tensor.shape, dtype=self.dtype, device=tensor.device)
        wire.copy_(tensor)
        return Payload([wire], ctx=tensor)

    def decompress(self, tensors, ctx):
        """The sum cast back into the tensor that was compressed (the bucket in a hook), which it returns."""
        if ctx is None:
            return tensors[0]
        return ctx.copy_(tensors[0])


@register("fp16", fsdp=EntrywiseRows)
def fp16() -> Method:
    """Cast to float16, all-reduce in float16, cast back: half the bytes, about 3 significant digits."""
    return Method(CastCompressor(torch.float16), NoMemory(), AllreduceCommunicator())


@register("bf16", fsdp=EntrywiseRows)
def bf16() -> Method:
    """Cast to bfloat16, all-reduce in bfloat16, cast back: half the bytes, fp32's range, 2-3 digits."""
    return Method(CastCompressor(torch.bfloat16), NoMemory(), AllreduceCommunicator())
