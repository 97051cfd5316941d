"""``randomk`` under FSDP2: k entries per destination shard at positions every rank draws alike."""
from __future__ import annotations

import time

import torch

from gcomp.collectives.reduce_scatter import reduce_scatter_sum
from gcomp.compressors.randomk import all_finite, uniform_subset
from gcomp.core import Payload
from gcomp.fsdp.codec import ShardedCodec


class RandomKCodec(ShardedCodec):
    """On the wire: for each destination shard of S entries, the values of k = max(1, int(ratio * S)) of its
    entries plus one flag entry (0, or NaN when this rank's input is not finite), in the reduce dtype: a
    (world, k + 1) matrix by one SUM reduce-scatter, world * (k + 1) entries per rank and call, no indices.

    The positions of each shard come from the method's own generator (``RandomKCompressor.generator``, seeded
    alike on every rank, advanced world times per call), so every rank sends the same positions of a shard and
    their values add up. Error feedback: the method's ``ResidualMemory`` on the rank's full unsharded input (every
    entry it did not send is added to its next step), per (parameter, shard) piece.
    """

    def reduce_scatter(self, output, input, layout, group, stats) -> None:
        compressor, memory, info = self.method.compressor, self.method.memory, layout.pieces
        world, width = layout.world, layout.shard_numel
        start = time.perf_counter()
        k = max(1, int(width * compressor.ratio))
        compensated = memory.compensate(input, info)
        flat = compensated.reshape(-1)
        index = torch.stack([uniform_subset(width, k, compressor.generator) for _ in range(world)])
        index = index.to(flat.device, non_blocking=True)
        positions = (index + torch.arange(world, device=flat.device)[:, None] * width).reshape(-1)
        values = flat.index_select(0, positions)
        if flat.device.type == "cpu":
            finite = all_finite(flat)
            flag = flat.new_full((1,), 0.0 if finite else float("nan"))
        else:  # no synchronisation on a GPU
            flag = torch.where(torch.isfinite(torch.stack(torch.aminmax(flat))).all(), 0.0, float("nan"))
            flag, finite = flag.reshape(1).to(flat.dtype), False
        wire = torch.cat([values.view(world, k), flag.expand(world, 1)], dim=1)
        # the memory sees one payload over the whole input: the sent values at their positions, one flag
        memory.update(compensated, info, compressor,
                      Payload([torch.cat([values, flag])], ctx=(flat.numel(), positions, info, finite)))
        stats["encode_s"] += time.perf_counter() - start
        shard = wire.new_empty(k + 1)
        reduce_scatter_sum(shard, wire.reshape(-1), group, stats)
        stats["bytes_sent"] += wire.numel() * wire.element_size()
        start = time.perf_counter()
        output.zero_().index_copy_(0, index[layout.rank], shard[:k] + shard[k])
        stats["decode_s"] += time.perf_counter() - start
