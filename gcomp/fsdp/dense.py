"""``identity``, ``fp16``, ``bf16`` under FSDP2: the whole input, encoded element-wise, reduce-scattered."""
from __future__ import annotations

import time

from gcomp.collectives.reduce_scatter import reduce_scatter_sum
from gcomp.compressors.identity import IdentityCompressor
from gcomp.fsdp.codec import ShardedCodec


class DenseCodec(ShardedCodec):
    """On the wire: the input as the method's compressor encodes it, entry for entry (``identity``: FSDP's reduce
    dtype, 32 bits per entry for fp32; ``fp16`` / ``bf16``: cast to 16 bits), by one SUM reduce-scatter
    (``gcomp.collectives.reduce_scatter``: an all-to-all on gloo). The compressor decodes this rank's reduced rows
    into the output shard (the casts cast back into it).

    ``identity`` divides after the sum, as FSDP does (bit for bit FSDP2's own result on two gloo ranks); the casts
    divide before (the 16-bit sum is then the mean, which does not overflow where the fp32 mean would not).
    """

    def __init__(self, method):
        super().__init__(method)
        self.prescale = not isinstance(method.compressor, IdentityCompressor)

    def reduce_scatter(self, output, input, layout, group, stats) -> None:
        compressor, world = self.method.compressor, layout.world
        start = time.perf_counter()
        payload = compressor.compress(input, layout.pieces)
        for t in payload.tensors:
            if t.numel() != input.numel():
                raise RuntimeError(f"{self.method.name}: its payload of {t.numel()} entries is not the input's "
                                   f"{input.numel()}, entry for entry, so it cannot be reduce-scattered")
        stats["encode_s"] += time.perf_counter() - start
        shards = [t.new_empty(t.numel() // world) for t in payload.tensors]
        for t, shard in zip(payload.tensors, shards):
            reduce_scatter_sum(shard, t.reshape(-1), group, stats)
            stats["bytes_sent"] += t.numel() * t.element_size()
        start = time.perf_counter()
        # the casts decode into their context, the tensor they encoded: here the output shard instead
        result = compressor.decompress(shards, None if payload.ctx is None else output)
        if result.data_ptr() != output.data_ptr():
            output.copy_(result.reshape(output.shape))
        stats["decode_s"] += time.perf_counter() - start
