"""All-gather of every payload tensor: each rank sees every other rank's payload."""
from __future__ import annotations

import torch
import torch.distributed as dist

from gcomp.collectives.counting import count_collectives, count_round
from gcomp.collectives.futures import launched, when_all_done
from gcomp.collectives.gather_flat import all_gather_flat
from gcomp.core import ALLGATHER, Communicator, Compressor, Payload


class AllgatherCommunicator(Communicator):
    """One asynchronous all-gather per payload tensor into a ``(world, *shape)`` tensor, then ``aggregate``.

    Payload tensors must have the same shape on every rank (gloo and NCCL need equal sizes): codecs pad or
    select a fixed count. Each rank receives ``world - 1`` payloads, so the traffic grows with the world size.
    """

    collective = ALLGATHER

    def exchange(self, payload: Payload, compressor: Compressor, group: dist.ProcessGroup | None,
                 stats: dict | None = None) -> torch.futures.Future:
        world = dist.get_world_size(group)
        outputs, futures = [], []
        for t in payload.tensors:
            out = t.new_empty(world * t.numel())  # gloo wants the flat form
            futures.append(launched(all_gather_flat(out, t.reshape(-1), group, async_op=True)))
            outputs.append(out.view(world, *t.shape))
        count_collectives(stats, "allgather", payload.tensors)
        count_round(stats)
        return when_all_done(futures, outputs)
