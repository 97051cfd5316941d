"""``spardl`` under FSDP2: SparDL's Spar-Reduce-Scatter is FSDP's reduce-scatter."""
from __future__ import annotations

import time

from gcomp.collectives.p2p import run_program
from gcomp.collectives.spardl import spar_reduce_scatter
from gcomp.fsdp.codec import ShardedCodec


class SparDLCodec(ShardedCodec):
    """On the wire, point-to-point only (``gcomp.collectives.spardl.spar_reduce_scatter``, run by
    ``gcomp.collectives.p2p.run_program``): FSDP's input viewed as (world, S) *is* SparDL's blocks, block r being
    rank r's shard. In ceil(log2 world) rounds every block but a rank's own is sent once, as the top
    k = max(1, int(density * S)) of what has accumulated in it, (int32 position, value) pairs: (world - 1) k pairs
    per rank and call, each message's two sections padded to 8 bytes. The rank's own block, its partial sums
    added in, is its output shard, dense: SparDL's final top-k and all-gather are not needed, since FSDP wants
    only the shard.

    Error feedback on the rank's full unsharded input: what it did not pass on of the other blocks (its own
    entries and the partial sums it cut) is its residual, added to its next step (the method's
    ``ResidualMemory``, per (parameter, shard) piece). The residuals of all ranks plus the shards add up to the
    sum of the inputs, exactly. ``teams`` must be 1 under FSDP2 (Spar-All-Gather has no place in a
    reduce-scatter).
    """

    def bind(self, model, group, stats) -> None:
        compressor = self.method.compressor
        if compressor.teams != 1:
            raise ValueError(f"spardl under FSDP2 takes teams=1 (its Spar-All-Gather across teams has no place in a "
                             f"reduce-scatter); got teams={compressor.teams}")

    def reduce_scatter(self, output, input, layout, group, stats) -> None:
        compressor = self.method.compressor
        memory, info, world, width = compressor.memory, layout.pieces, layout.world, layout.shard_numel
        start = time.perf_counter()
        k = max(1, int(width * compressor.density))
        blocks = memory.compensate(input, info).reshape(world, width).clone()
        stats["encode_s"] += time.perf_counter() - start
        program = spar_reduce_scatter(blocks, layout.rank, k, lambda m: m)
        _, sent, messages = run_program(program, group, device=blocks.device, stats=stats)
        stats["bytes_sent"] += sent
        stats["messages"] += messages
        start = time.perf_counter()
        output.copy_(blocks[layout.rank])
        blocks[layout.rank].zero_()
        memory.store(blocks.view(-1), info)  # what this rank did not pass on
        stats["decode_s"] += time.perf_counter() - start
