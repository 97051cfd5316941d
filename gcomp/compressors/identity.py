"""``identity``: plain all-reduce, the baseline."""
from __future__ import annotations

from gcomp.collectives import AllreduceCommunicator
from gcomp.core import ALLREDUCE, Compressor, Payload
from gcomp.memory import NoMemory
from gcomp.method import Method
from gcomp.registry import register
from gcomp.sharding import EntrywiseRows


class IdentityCompressor(Compressor):
    """Sends the bucket unchanged (its own dtype, 32 bits per element for fp32) by SUM all-reduce."""

    collective = ALLREDUCE
    lossless = True

    def compress(self, tensor, bucket):
        return Payload([tensor])

    def decompress(self, tensors, ctx):
        return tensors[0]


@register("identity", fsdp=EntrywiseRows)
def identity() -> Method:
    """Plain all-reduce of the whole bucket, bit-identical to DDP without a hook: the baseline."""
    return Method(IdentityCompressor(), NoMemory(), AllreduceCommunicator())
