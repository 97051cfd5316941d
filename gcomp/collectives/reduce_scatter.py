"""SUM reduce-scatter of a flat tensor laid out shard-major (FSDP2's reduce-scatter input): rank r ends with the
sum over ranks of row r of ``input.view(world, -1)``.

On NCCL (and any backend but gloo) this is the backend's own ``reduce_scatter_single``. On gloo it is one
``all_to_all_single`` followed by a local sum over the received rows, in rank order: gloo's own reduce-scatter
runs an all-reduce and keeps a slice (measured on loopback with 4 ranks and a 40 MB input: 60 MB sent per rank,
what an all-reduce sends, against 30 MB for the all-to-all), so the all-to-all moves half the bytes of plain
FSDP2's reduce-scatter on gloo: (world - 1) / world of the input leaves each rank, as in an ideal reduce-scatter.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from gcomp.collectives.counting import _add, count_round

KEYS = ("reduce_scatter_calls", "reduce_scatter_bytes")


def reduce_scatter_sum(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None,
                       stats: dict | None = None) -> torch.Tensor:
    """Write into ``output`` (``input.numel() // world`` entries) the SUM over ranks of this rank's row of
    ``input``; waits for it (FSDP2 reads the output when its reduce-scatter call returns). Counted in ``stats``
    as one round and one reduce-scatter of ``input``'s bytes. ``input`` may be overwritten (gloo's path keeps
    it; NCCL's leaves it as it was)."""
    world = dist.get_world_size(group)
    if input.numel() != output.numel() * world:
        raise ValueError(f"reduce-scatter: an input of {input.numel()} entries does not split into {world} rows of "
                         f"{output.numel()}")
    _add(stats, "reduce_scatter_calls", 1)
    _add(stats, "reduce_scatter_bytes", input.numel() * input.element_size())
    count_round(stats)
    if dist.get_backend(group) != "gloo":
        native = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # torch <= 2.12
        native(output, input, group=group)
        return output
    received = torch.empty_like(input)
    dist.all_to_all_single(received, input, group=group)
    torch.sum(received.view(world, -1), dim=0, out=output.view(-1))
    return output
