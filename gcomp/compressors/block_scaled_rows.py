"""FSDP2's reduce-scatter for ``fp8`` and ``mx``: the first of their two phases alone."""
from __future__ import annotations

from gcomp.collectives.two_phase import all_to_all_rows
from gcomp.sharding import RowStrategy


class TwoPhaseRows(RowStrategy):
    """Under FSDP2 the first phase alone is the reduce-scatter: each of FSDP's N rows (S entries, destination
    shard r) padded with zeros to a multiple of the format's block (c entries) and encoded on its own, row r sent
    to rank r by ``all_to_all_single`` (N encoded rows of ``fmt.wire_bytes(c)`` bytes handed over per call, N - 1
    of them leaving the rank), and rank r's output shard the fp32 sum of the N rows it received, decoded. No
    second rounding, so no owner error: error feedback is the method's ``ResidualMemory`` on the rank's full
    input, per (parameter, shard) piece, re-sharded by parameter on another number of shards."""

    reshards = True

    def compress(self, compressor, tensor, layout):
        return compressor.compress_rows(tensor, layout.pieces, layout.world)

    def exchange(self, payload, compressor, layout, group, stats):
        return all_to_all_rows(payload.tensors, group, stats)

    def decode(self, compressor, received, payload, layout, output):
        total = compressor.sum_received(received, payload.ctx.width, output.dtype, payload.ctx.bucket)
        output.view(-1).copy_(total[:payload.ctx.valid])
